"""The quick start, for real: the default config (SmolLM2-135M-Instruct, 2 replicas, bfloat16
where the CPU has it, deterministic serving) under `serve run`, the README's openai SDK snippet
run as written against it, and `temperature: 0` reproducible: the same greedy streams sent
twice give the same texts, and with the busiest replica SIGKILLed mid-stream too.

Only the ports differ from `make serve`: the HTTP port is a free one and the index uses a
test redis-server, so the test never touches a cluster a person is running.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from conftest import keep_logs
from pydantic import BaseModel
from streams import resumed, run_streams

from bench.assistant_prompts import LONG_DOCUMENT, SUPPORT_SYSTEM_PROMPT
from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from replica.checkpoints import SMOLLM2

REPO = Path(__file__).resolve().parent.parent
SNIPPET_MARK = "<!-- quickstart-snippet"


def default_args(redis_url: str) -> ClusterArgs:
    config = yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())
    args = ClusterArgs.model_validate(config["applications"][0]["args"])
    return args.model_copy(update={"index": IndexConfig(url=redis_url, cluster="quickstart")})


def readme_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    after = readme[readme.index(SNIPPET_MARK) :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    c = ServeCluster(default_args(redis_server.url)).start(timeout_s=300)
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


def test_the_default_config_serves_smollm2(cluster: ServeCluster) -> None:
    assert cluster.args.engine.model == SMOLLM2
    models = httpx.get(f"{cluster.base_url}/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(SMOLLM2, 8192)]


def test_the_readme_snippet_answers_paris_and_then_hits_the_cache(cluster: ServeCluster) -> None:
    code = readme_snippet().replace("http://127.0.0.1:8000/v1", f"{cluster.base_url}/v1")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md quick start", "exec"), {})
    answer, cached = printed.getvalue().splitlines()
    assert "Paris" in answer
    assert int(cached) > 0


def test_streamed_text_equals_the_whole_reply_and_hides_the_end_token(
    cluster: ServeCluster,
) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Write one short sentence about mountains 🏔️."}]
    whole = client.chat.completions.create(
        model=SMOLLM2, messages=messages, max_tokens=48, temperature=0
    )
    chunks = client.chat.completions.create(
        model=SMOLLM2, messages=messages, max_tokens=48, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = whole.choices[0].message.content
    assert streamed == text and text
    assert "<|im_end|>" not in text and "\ufffd" not in text
    assert whole.choices[0].finish_reason == "stop"  # it ended at <|im_end|>, not the limit


def drafts_kept(cluster: ServeCluster) -> int:
    replicas = cluster.stats()["replicas"].values()
    return sum(r.get("accepted_draft_tokens") or 0 for r in replicas)


def test_drafts_change_no_text_and_a_request_may_opt_out(cluster: ServeCluster) -> None:
    """A reply that copies its prompt, with the engine's drafts (the default) and with
    ``"speculation": false``, streamed and whole: one text; the replicas count drafts kept."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    messages = [
        {"role": "user", "content": "Repeat this exactly:\n\n" + LONG_DOCUMENT[:600]},
    ]
    before = drafts_kept(cluster)
    texts = []
    for extra in ({"speculation": False}, {}):
        whole = client.chat.completions.create(
            model=SMOLLM2, messages=messages, max_tokens=80, temperature=0, extra_body=extra
        )
        chunks = client.chat.completions.create(
            model=SMOLLM2,
            messages=messages,
            max_tokens=80,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        texts += [whole.choices[0].message.content, streamed]
    assert len(set(texts)) == 1 and texts[0]
    deadline = time.monotonic() + 30  # replicas report their counters every few seconds
    while drafts_kept(cluster) <= before:
        assert time.monotonic() < deadline, "no replica counted a kept draft"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"prompt": "Hello " * 9000, "max_tokens": 8}, 400, "context_length_exceeded"),
        ({"prompt": [1, 2, 49152], "max_tokens": 4}, 400, None),
        ({"prompt": [1, 2, -1], "max_tokens": 4}, 400, None),
        ({"model": "tiny-llama-6m", "prompt": "hi"}, 404, "model_not_found"),
    ],
)
def test_bad_input_on_the_real_model_gets_an_openai_error(
    cluster: ServeCluster, body: dict, status: int, code: str | None
) -> None:
    resp = httpx.post(
        f"{cluster.base_url}/v1/completions", json={"model": SMOLLM2, **body}, timeout=60
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in resp.text


class City(BaseModel):
    name: str
    country: str
    population: int
    coastal: bool


CITIES = [
    "Paris",
    "Tokyo",
    "Lagos",
    "Lima",
    "Oslo",
    "Cairo",
    "Sydney",
    "Toronto",
    "Mumbai",
    "Berlin",
    "Nairobi",
    "Seoul",
    "Madrid",
    "Hanoi",
    "Quito",
    "Dublin",
    "Perth",
    "Dakar",
    "Riga",
    "Porto",
]


def test_parse_returns_a_validated_object_for_every_prompt(cluster: ServeCluster) -> None:
    """The openai SDK's ``parse`` with a pydantic model: 20 prompts, every reply valid JSON of
    that schema (decoding is held to it), concurrently over both replicas."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)

    def ask(city: str) -> tuple[City | None, str]:
        reply = client.chat.completions.parse(
            model=SMOLLM2,
            messages=[{"role": "user", "content": f"Describe the city of {city} as JSON."}],
            response_format=City,
            max_tokens=120,
            temperature=0,
        )
        choice = reply.choices[0]
        return choice.message.parsed, choice.finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, CITIES))
    for parsed, finish in replies:
        assert finish == "stop" and isinstance(parsed, City)


def test_json_object_replies_are_json_objects_or_cut_at_the_budget(cluster: ServeCluster) -> None:
    """OpenAI's rule for ``json_object``: a reply that stops is a JSON object; one that runs
    out of ``max_tokens`` is cut (``finish_reason: length``). Greedy SmolLM2 repeats keys on
    open-ended requests like these, so both happen; a cut reply is still the start of one."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    asks = ["Give me a JSON object describing a dog.", "Reply in JSON: your name and age."]
    for ask in asks:
        reply = client.chat.completions.create(
            model=SMOLLM2,
            messages=[{"role": "user", "content": ask}],
            response_format={"type": "json_object"},
            max_tokens=120,
            temperature=0,
        )
        choice = reply.choices[0]
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length"
            assert reply.usage.completion_tokens == 120
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)


TOPICS = [
    "a lost tent",
    "a stove",
    "a parcel",
    "a refund",
    "a size",
    "a warranty",
    "a storm",
    "a map",
]


def story_bodies() -> list[dict]:
    """8 greedy chats of 160 tokens sharing a ~600-token system prompt."""
    return [
        {
            "model": SMOLLM2,
            "messages": [
                {"role": "system", "content": SUPPORT_SYSTEM_PROMPT},
                {"role": "user", "content": f"Tell me a short story about {topic}."},
            ],
            "max_tokens": 160,
            "ignore_eos": True,
            "temperature": 0,
        }
        for topic in TOPICS
    ]


@pytest.fixture(scope="module")
def undisturbed(cluster: ServeCluster) -> list[str]:
    streams, _ = run_streams(cluster, story_bodies(), kill=False)
    assert all(s.errors == [] and s.usage["completion_tokens"] == 160 for s in streams)
    return [s.text for s in streams]


def test_the_same_greedy_requests_sent_twice_give_identical_texts(
    cluster: ServeCluster, undisturbed: list[str]
) -> None:
    """Batched differently, with the system prompt cached this time: the same texts."""
    streams, _ = run_streams(cluster, story_bodies(), kill=False)
    assert [s.text for s in streams] == undisturbed
    assert len(set(undisturbed)) == len(undisturbed)  # eight different stories


def test_a_replica_killed_mid_stream_changes_no_client_text(
    cluster: ServeCluster, undisturbed: list[str]
) -> None:
    """Last in this module: it kills a replica (Serve replaces it)."""
    before = resumed(cluster)
    streams, victim = run_streams(cluster, story_bodies(), kill=True)
    on_victim = [s for s in streams if s.replica == victim]
    assert on_victim  # the kill hit streams in flight
    for got, want in zip(streams, undisturbed, strict=True):
        assert got.errors == []
        assert got.text == want
        assert got.usage is not None and got.usage["completion_tokens"] == 160
    assert resumed(cluster) - before >= len(on_victim)
