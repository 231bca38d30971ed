"""How a reply's text becomes content or a tool call (``cluster.api.tools``), piece by piece as
a stream delivers it: the deltas a client assembles always give the same message as the whole
reply, whatever the split."""

from __future__ import annotations

import json

import pytest

from cluster.api.formats import Tool
from cluster.api.models import ChatCompletionRequest
from cluster.api.tools import ToolCallStream, template_messages

TOOLS = [
    Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ),
    Tool.model_validate({"type": "function", "function": {"name": "now"}}),
]


def assemble(deltas: list[dict]) -> dict:
    """What the openai SDK builds from streamed deltas."""
    content, calls = None, {}
    for delta in deltas:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"function": {"arguments": ""}})
            call.update({k: v for k, v in part.items() if k in ("id", "type")})
            function = part.get("function", {})
            if "name" in function:
                call["function"]["name"] = function["name"]
            call["function"]["arguments"] += function.get("arguments", "")
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def run(mode: str, text: str, split: int, named: str | None = None) -> tuple[dict, dict]:
    """(the message assembled from deltas of pieces of ``split`` characters, the whole one)."""
    stream = ToolCallStream(mode, TOOLS, named)
    deltas = []
    for i in range(0, len(text), split):
        deltas += stream.push(text[i : i + split])
    deltas += stream.finish()
    return assemble(deltas), stream.message()


def same(streamed: dict, whole: dict) -> None:
    if whole.get("tool_calls"):
        assert streamed["tool_calls"][0]["id"] == whole["tool_calls"][0]["id"]
        assert streamed["tool_calls"][0]["function"] == whole["tool_calls"][0]["function"]
        assert not streamed["content"]
    else:
        assert streamed["content"] == whole["content"]


@pytest.mark.parametrize("split", [1, 2, 3, 7, 1000])
def test_required_streams_the_name_then_the_arguments(split: int) -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Paris {x}"}}'
    streamed, whole = run("required", text, split)
    same(streamed, whole)
    call = whole["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris {x}"}'}
    assert whole["content"] is None and call["id"].startswith("call_")


@pytest.mark.parametrize("split", [1, 4, 1000])
def test_named_streams_the_whole_reply_as_arguments(split: int) -> None:
    text = '{"city": "Oslo"}'
    streamed, whole = run("named", text, split, named="get_weather")
    same(streamed, whole)
    assert whole["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": text}


@pytest.mark.parametrize("split", [1, 3, 1000])
@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
        '  <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}',
        '{"name": "now", "arguments": {}}',
    ],
)
def test_auto_recognises_a_call(text: str, split: int) -> None:
    streamed, whole = run("auto", text, split)
    same(streamed, whole)
    assert whole["tool_calls"][0]["function"]["name"] in ("now", "get_weather")
    json.loads(whole["tool_calls"][0]["function"]["arguments"])


@pytest.mark.parametrize("split", [1, 5, 1000])
@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "unknown", "arguments": {}}',  # not one of the tools
        '{"city": "Paris"}',  # JSON, but no call
        "<tool_c and then prose",
        '<tool_call>{"name": "now", "arguments": [1]}',  # arguments must be an object
    ],
)
def test_auto_leaves_everything_else_as_content(text: str, split: int) -> None:
    streamed, whole = run("auto", text, split)
    assert whole == {"role": "assistant", "content": text}
    same(streamed, whole)


def test_prose_streams_at_once_once_it_cannot_be_a_call() -> None:
    stream = ToolCallStream("auto", TOOLS)
    assert stream.push("<tool") == []  # could still be <tool_call>
    assert stream.push("box is") == [{"content": "<toolbox is"}]
    assert stream.push(" open") == [{"content": " open"}]


def test_a_call_cut_short_before_its_name_is_content() -> None:
    streamed, whole = run("required", '{"name": "get_w', 3)
    assert whole == {"role": "assistant", "content": '{"name": "get_w'}
    same(streamed, whole)


def test_tools_reach_a_template_without_tool_support_as_a_system_message() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [t.model_dump(exclude_none=True) for t in TOOLS],
        }
    )
    messages = template_messages(body, template_has_tools=False)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert "get_weather" in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city":"Oslo"}}</tool_call>'
    )
    assert messages[3] == {"role": "tool", "content": "sunny"}
    none = body.model_copy(update={"tool_choice": "none"})
    assert "<tools>" not in template_messages(none, template_has_tools=False)[0]["content"]
