"""The OpenAI API as clients use it, through the official SDK: n, logprobs, echo, penalties,
logit bias, min_tokens, stop token ids, batched prompts, replies held to a schema
(``parse``), tool calls streamed and not; the OpenAPI document checked by schemathesis; and
API keys that isolate each other's cached prefixes, on one replica."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from conftest import keep_logs, tiny
from pydantic import BaseModel, Field

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from router.config import routing_config

MODEL = "tiny-llama-6m"
KEYS = ["sk-one", "sk-two"]
PROMPT = "The weather in Lisbon tomorrow will be"
# the three rules no JSON Schema can state (every other one is in the document)
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    args = ClusterArgs(
        num_replicas=1,  # isolation is checked on the very same replica
        engine=tiny(num_threads=1, num_blocks=512, max_model_len=4096),
        api_keys=KEYS,
        max_tokens_limit=64,  # the document's bound: any max_tokens it allows fits the context
        routing=routing_config(stats_period_s=0.5),
        index=IndexConfig(url=redis_server.url, cluster="api"),
    )
    c = ServeCluster(args).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


@pytest.fixture(scope="module")
def client(cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEYS[0], max_retries=0)


def complete(client: openai.OpenAI, **kw) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=PROMPT, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_equal_separate_requests_with_consecutive_seeds(client, stream: bool) -> None:
    sampled = {"max_tokens": 10, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    texts = {}
    if stream:
        for chunk in complete(client, n=3, seed=40, stream=True, **sampled):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = None
    else:
        reply = complete(client, n=3, seed=40, **sampled)
        texts = {c.index: c.text for c in reply.choices}
        usage = reply.usage
    alone = [complete(client, n=1, seed=40 + i, **sampled) for i in range(3)]
    assert [texts[i] for i in range(3)] == [a.choices[0].text for a in alone]
    assert len(set(texts.values())) == 3
    if usage is not None:  # the prompt counts once, every choice's tokens count
        assert usage.prompt_tokens == alone[0].usage.prompt_tokens
        assert usage.completion_tokens == 30


def test_chat_n_choices_stream_and_not(client) -> None:
    messages = [{"role": "user", "content": "Pick a number."}]
    kw = {"model": MODEL, "messages": messages, "max_tokens": 6, "n": 2, "seed": 5}
    whole = client.chat.completions.create(temperature=0.9, **kw)
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(temperature=0.9, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [c.message.content for c in whole.choices] == [streamed[0], streamed[1]]


def test_completion_logprobs_give_the_sampled_token_and_its_alternatives(client) -> None:
    reply = complete(client, max_tokens=6, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == reply.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # log-probabilities of one distribution: below 0 (a random model is never sure) and
        # the alternatives' probabilities sum to at most 1
        assert len(top) <= 3 and value < 0
        assert math.fsum(math.exp(v) for v in top.values()) <= 1 + 1e-6
        assert value == pytest.approx(max(top.values()))  # greedy: the most likely token
        if "\ufffd" not in token:  # a partial character: several ids share that text
            assert top[token] == pytest.approx(value)
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = [
        c.choices[0].logprobs.token_logprobs
        for c in complete(client, max_tokens=6, temperature=0, logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [v for values in streamed for v in values] == pytest.approx(lp.token_logprobs)


def test_chat_logprobs_and_top_logprobs_stream_and_not(client) -> None:
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
    }
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 5
    for entry in whole:
        assert len(entry.top_logprobs) == 4
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    chunks = client.chat.completions.create(stream=True, **kw)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)


def test_echo_scores_the_prompt_token_by_token(client) -> None:
    reply = complete(client, max_tokens=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == PROMPT
    assert reply.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == reply.usage.prompt_tokens
    scored = lp.token_logprobs[1:]
    assert lp.token_logprobs[0] is None and all(v < 0 for v in scored)
    assert len(set(scored)) > 1  # each token scored on its own, not one value for all
    again = complete(client, max_tokens=0, echo=True, logprobs=1)  # cached now, still scored
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs)
    both = complete(client, max_tokens=4, echo=True, temperature=0)
    assert both.choices[0].text.startswith(PROMPT) and len(both.choices[0].text) > len(PROMPT)


def test_logit_bias_min_tokens_and_stop_token_ids(client) -> None:
    z = ord("Z")
    forced = complete(client, max_tokens=5, temperature=0, logit_bias={str(z): 100})
    assert forced.choices[0].text == "ZZZZZ"
    # "Z" ends the text but only after 3 other tokens; the stop token itself is not shown
    held = complete(
        client,
        max_tokens=8,
        temperature=0,
        logit_bias={str(z): 100},
        extra_body={"min_tokens": 3, "stop_token_ids": [z]},
    )
    assert held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 4 and "Z" not in held.choices[0].text


def test_each_penalty_alone_turns_greedy_text_away_from_repeats(client) -> None:
    """Greedy text of the tiny model repeats a token within 16; each penalty, sent alone,
    must change that text (a server that accepted and ignored one would return it as is)."""
    plain = {"max_tokens": 16, "temperature": 0}
    greedy = complete(client, **plain, extra_body={"ignore_eos": True}).choices[0].text
    for penalty in (
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.5},
        {"extra_body": {"repetition_penalty": 1.3}},
    ):
        extra = {"ignore_eos": True, **penalty.pop("extra_body", {})}
        reply = complete(client, **plain, **penalty, extra_body=extra)
        assert reply.usage.completion_tokens == 16
        assert reply.choices[0].text != greedy, penalty


def test_api_keys_never_share_cached_prefixes_on_one_replica(cluster: ServeCluster) -> None:
    prompt = "A system prompt long enough to fill several blocks for both keys. " * 4

    def cached(key: str) -> int:
        c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=key, max_retries=0)
        return c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2
        ).usage.prompt_tokens_details.cached_tokens

    assert cached(KEYS[0]) == 0
    assert cached(KEYS[0]) > 0  # the same key shares
    assert cached(KEYS[1]) == 0  # another key never does, though it is the same replica
    assert len(cluster.stats()["replicas"]) == 1


def test_the_openapi_document_is_truthful(cluster: ServeCluster) -> None:
    auth = {"authorization": f"Bearer {KEYS[0]}"}
    doc = httpx.get(f"{cluster.base_url}/openapi.json", headers=auth).json()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert set(completions) == {"200", "400", "401", "404", "413", "500", "503"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    resp = httpx.put(f"{cluster.base_url}/v1/completions", headers=auth)
    assert resp.status_code == 405 and "POST" in resp.headers["allow"]
    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            f"{cluster.base_url}/openapi.json",
            "--checks",
            "all",
            "--seed",
            "1",
            "--header",
            f"Authorization: Bearer {KEYS[0]}",
            "--max-response-time",
            "30",
            "--workers",
            "2",
        ],
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-12000:]


def test_a_batch_of_prompts_gets_a_choice_per_prompt_and_n(client) -> None:
    prompts = ["The sea", "A mountain", "ABC", ""]
    kw = {"max_tokens": 5, "temperature": 1.0, "seed": 9, "extra_body": {"ignore_eos": True}}
    reply = client.completions.create(model=MODEL, prompt=prompts, n=2, **kw)
    assert sorted(c.index for c in reply.choices) == list(range(8))
    texts = {c.index: c.text for c in reply.choices}
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == texts
    for i, prompt in enumerate(prompts):  # prompt i's choices are i * n + j, as alone
        alone = client.completions.create(model=MODEL, prompt=prompt, n=2, **kw)
        assert [texts[2 * i], texts[2 * i + 1]] == [c.text for c in alone.choices]
    assert reply.usage.completion_tokens == 8 * 5
    singles = [client.completions.create(model=MODEL, prompt=p, **kw) for p in prompts]
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    ids = client.completions.create(model=MODEL, prompt=[[256, 65, 66, 67], [68]], **kw)
    assert [c.index for c in ids.choices] == [0, 1]
    assert ids.choices[0].text == texts[4]  # "ABC" as ids (BOS first): the same text


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=6)
    age: int = Field(ge=0, le=120)
    ok: bool


def test_the_sdk_parses_replies_held_to_a_pydantic_model(client) -> None:
    for i in range(5):
        reply = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Person number {i}, as JSON."}],
            response_format=Person,
            max_tokens=64,
            temperature=0.8,
            seed=i,
        )
        assert isinstance(reply.choices[0].message.parsed, Person)


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "weather"}}, "required"]
)
def test_a_required_tool_call_streams_and_not_with_valid_arguments(client, tool_choice) -> None:
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER, CLOCK],
        "tool_choice": tool_choice,
        "max_tokens": 64,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    arguments = json.loads(call.function.arguments)
    if call.function.name == "weather":
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    else:
        assert tool_choice == "required" and call.function.name == "clock"
    with client.chat.completions.stream(**kw) as stream:  # the SDK assembles the deltas
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.tool_calls[0].function.name == call.function.name
    assert final.message.tool_calls[0].function.arguments == call.function.arguments


def test_with_tool_choice_none_or_no_call_the_reply_is_content(client) -> None:
    kw = {"model": MODEL, "max_tokens": 8, "temperature": 0, "tools": [WEATHER]}
    messages = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")
    # a conversation that carries an earlier call and its result back in
    messages += [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    after = client.chat.completions.create(messages=messages, **kw)
    assert after.usage.prompt_tokens > plain.usage.prompt_tokens
