"""A Qwen3 folder served by the whole cluster (real Ray Serve replica, the official SDK): the
ingress renders the conversation with the model's own template, tools and an earlier call
included, and the reply is what the engine alone computes for those prompt ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import keep_logs

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from bench.model_families import build_family
from cluster.api.models import ChatCompletionRequest
from cluster.api.tools import template_messages, template_tools
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from replica.checkpoints import checkpoint_for
from replica.config import EngineConfig
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams
from router.config import routing_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 4 °C"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_family("qwen3", tmp_path_factory.mktemp("serving") / "qwen3")


def engine_config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), dtype="bfloat16", num_threads=1, num_blocks=256)


@pytest.fixture(scope="module")
def cluster(folder, redis_server: LocalRedis, request) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    args = ClusterArgs(
        num_replicas=1,
        engine=engine_config(folder),
        routing=routing_config(stats_period_s=0.5),
        index=IndexConfig(url=redis_server.url, cluster="families"),
    )
    c = ServeCluster(args).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


def test_a_qwen3_folder_answers_through_the_cluster_as_the_engine_does(folder, cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0)
    (served,) = client.models.list().data
    reply = client.chat.completions.create(
        model=served.id, messages=MESSAGES, tools=[WEATHER], max_tokens=16, temperature=0
    )
    tokenizer = checkpoint_for(str(folder)).tokenizer()
    body = ChatCompletionRequest.model_validate(
        {"model": served.id, "messages": MESSAGES, "tools": [WEATHER]}
    )
    prompt = tokenizer.render_chat(template_messages(body, True), template_tools(body))
    assert "<tool_response>\nsunny, 4 °C\n</tool_response>" in prompt
    ids = tokenizer.encode_chat(prompt)
    assert reply.usage.prompt_tokens == len(ids)
    alone = build_engine(engine_config(folder)).generate([ids], SamplingParams(max_tokens=16))[0]
    message = reply.choices[0].message
    text = message.content or ""
    assert message.tool_calls is None and text == tokenizer.decode(alone.token_ids)
    assert reply.usage.completion_tokens == len(alone.token_ids)
