"""Each family's chat template from its own files, as transformers renders it, through the
ingress's path: 20 conversations per family (system, developer, user, assistant turns, tool
calls and their results, with the tools listed), our prompt text equal to
``apply_chat_template`` on the conversation written the way transformers documents it for
tool-aware templates. Calls and results come out in the family's own format."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import transformers

from bench.model_families import FAMILIES, build_family
from cluster.api.models import ChatCompletionRequest
from cluster.api.tools import ToolCallStream, template_messages, template_tools
from replica.checkpoints import checkpoint_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the manual",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]
TEXTS = [
    "Hello!",
    "Quel temps fait-il à Paris ? ☀️",
    "富士山の天気は？",
    "List three colours.",
    "Сколько будет 2 + 2?",
    "Summarise: the cache keeps full blocks.",
    "  padded  ",
]
# each family's own way of writing a call and a result in the prompt
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
CALL_FORMAT = {"llama3": '{"name": "get_weather", "parameters": {"city": ', "qwen2": QWEN_CALL}
CALL_FORMAT["qwen3"] = QWEN_CALL
RESULT_FORMAT = {"llama3": "ipython", "qwen2": "<tool_response>", "qwen3": "<tool_response>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-families")
    return {f: build_family(f, root / f) for f in sorted(FAMILIES)}


def conversation(rng: random.Random, with_tools: bool) -> list[dict[str, Any]]:
    """An OpenAI-format conversation: an optional system (or developer) message, a user
    message, then turns of assistant text or one tool call answered by its tool result."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": rng.choice(["system", "developer"]), "content": "Be brief."})
    messages.append({"role": "user", "content": rng.choice(TEXTS)})
    for turn in range(rng.randint(0, 3)):
        if with_tools and rng.random() < 0.6:
            args = {"city": rng.choice(["Paris", "東京"]), "days": rng.randint(1, 5)}
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)}}  # fmt: skip
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": "sunny"})
        else:
            messages.append({"role": "assistant", "content": rng.choice(TEXTS)})
        if rng.random() < 0.7:
            messages.append({"role": "user", "content": rng.choice(TEXTS)})
    return messages


def transformers_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as transformers' chat-template guide writes it: calls' arguments as
    objects, developer as system, no empty content beside calls."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m["role"] == "developer":
            m["role"] = "system"
        if "tool_calls" in m:
            m["tool_calls"] = [as_object(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def as_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_twenty_conversations_render_as_transformers_renders_them(folders, family) -> None:
    tokenizer = checkpoint_for(str(folders[family])).tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(str(folders[family]))
    assert tokenizer.template_has_tools
    assert hf.convert_tokens_to_ids(FAMILIES[family][4]) in tokenizer.stop_token_ids
    rng = random.Random(family)
    calls = results = 0
    for i in range(20):
        with_tools = i % 3 != 0
        messages = conversation(rng, with_tools)
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, **({"tools": TOOLS} if with_tools else {})}
        )
        ours = tokenizer.render_chat(template_messages(body, True), template_tools(body))
        want = hf.apply_chat_template(
            transformers_form(messages),
            tools=TOOLS if with_tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
        assert ours == want, (family, i)
        assert tokenizer.encode_chat(ours) == hf(want, add_special_tokens=False)["input_ids"]
        has_call = any(m.get("tool_calls") for m in messages)
        assert (CALL_FORMAT[family] in ours) == has_call, (family, i)
        calls += has_call
        results += RESULT_FORMAT[family] in ours
    assert calls >= 5 and results >= 5


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ],
    ids=["qwen", "llama3"],
)
def test_each_family_s_own_call_format_is_read_back_as_a_tool_call(reply) -> None:
    stream = ToolCallStream("auto", [ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    ).tools[0]])  # fmt: skip
    for piece in (reply[:7], reply[7:30], reply[30:]):
        assert stream.push(piece) == []  # held: it may be a call
    stream.finish()
    call = stream.message()["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
