"""Tool calls: the tools in the prompt, and a reply's text turned into ``tool_calls``.

Prompt: a chat template that knows tools (Llama 3's, Qwen2.5's, Qwen3's) renders them itself,
and gets the conversation as transformers documents it for such templates: an assistant
message's ``tool_calls`` with their arguments as objects, ``tool`` messages as they came, so
each family writes calls and results in its own format (Qwen's ``<tool_call>`` and
``<tool_response>``, Llama 3's ``"parameters"`` object). Otherwise (SmolLM2's template knows
no tools) a system message lists them and asks for a call as ``<tool_call>{"name": ...,
"arguments": ...}</tool_call>``, and earlier calls are written back the same way, as text.
``tool_choice: none`` leaves the tools out of the prompt.

Reply, by mode (``ChatCompletionRequest.tool_mode``):

* ``named``: decoding is held to the function's arguments (``cluster.api.structured``); the
  whole reply is the call's ``arguments``.
* ``required``: held to ``{"name": ..., "arguments": ...}`` over the tools; the call's name
  streams as soon as it is complete, then its arguments as they come.
* ``auto``: free text. It is a call when, stripped, it is ``<tool_call>`` followed by such an
  object (the closing tag optional), or is such an object alone, naming a tool (its
  arguments under ``arguments``, or ``parameters`` as Llama 3 writes them); anything else is
  content. While the text could still become a call (it starts with ``{`` or with
  ``<tool_call>`` or a prefix of it) it is held back, then sent as a call or as content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from cluster.api.formats import Tool, ToolCall
from cluster.api.models import ChatCompletionRequest, ChatMessage

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME_FIRST = re.compile(
    r'^\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)'
)  # once they start
_CLOSERS = " \t\r\n}"


def tool_preamble(tools: list[Tool]) -> str:
    listed = json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False)
    return (
        "You can call functions. To call one, reply with only "
        f'{OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE}\n'
        f"The functions:\n<tools>\n{listed}\n</tools>"
    )


def template_messages(body: ChatCompletionRequest, template_has_tools: bool) -> list[dict]:
    """The conversation as the chat template takes it (``developer`` as ``system``; tool
    calls as the template's own, or written back as text), the tool list in a system
    message where the template has none."""
    if template_has_tools:
        return [_as_native(m) for m in body.messages]
    messages = [_as_template(m) for m in body.messages]
    if body.tools and body.tool_mode != "none" and not template_has_tools:
        preamble = tool_preamble(body.tools)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{preamble}"
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    if not body.tools or body.tool_mode == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def _as_native(m: ChatMessage) -> dict[str, Any]:
    """A message as tool-aware templates read it: ``tool_calls`` only where there are calls
    (Llama 3's template tests for the key), each call's arguments parsed into an object
    (Qwen2.5's and Llama 3's write them with ``tojson``), no content key on a call with
    no text."""
    message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    if m.text or not m.tool_calls:
        message["content"] = m.text
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in m.tool_calls
        ]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as an object; a string that is not JSON stays a string (the
    template then writes it as it came)."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _as_template(m: ChatMessage) -> dict[str, str]:
    role = "system" if m.role == "developer" else m.role
    text = m.text
    for call in m.tool_calls or []:
        written = f'{{"name": {json.dumps(call.function.name)}, "arguments": '
        text += f"{OPEN}{written}{call.function.arguments}}}{CLOSE}"
    return {"role": role, "content": text}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallStream:
    """One choice's text as chat deltas: content, or one tool call (id, name, arguments)."""

    def __init__(self, mode: str, tools: list[Tool], named: str | None = None) -> None:
        self.mode = mode
        self.names = {t.function.name for t in tools}
        self.text = ""  # everything so far
        self.call_id = new_call_id()
        self.name: str | None = named
        self._sent = 0  # characters of text already sent (as content or as arguments)
        self._args_from: int | None = 0 if mode == "named" else None
        self._started = False

    @property
    def is_call(self) -> bool:
        return self.name is not None

    def push(self, piece: str) -> list[dict[str, Any]]:
        """Deltas for the new text (possibly none: held back)."""
        self.text += piece
        if self.mode == "auto":
            return self._auto()
        if self._args_from is None:
            match = _NAME_FIRST.match(self.text)
            if match is None:
                return []
            self.name, self._args_from = json.loads(match.group(1)), match.end()
        return self._arguments(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held, at the end of the reply."""
        if self.mode == "auto":
            if self._sent == 0 and self._parse_auto():
                return self._arguments(final=True)
            return self._content_delta(len(self.text))
        if self._args_from is None:  # cut short before the name was complete
            return self._content_delta(len(self.text))
        return self._arguments(final=True)

    def message(self) -> dict[str, Any]:
        """The whole reply as an assistant message (after ``finish``)."""
        if not self.is_call:
            return {"role": "assistant", "content": self.text}
        return {"role": "assistant", "content": None, "tool_calls": [self._call(self.arguments)]}

    @property
    def arguments(self) -> str:
        assert self._args_from is not None
        return self._strip_outer(self.text[self._args_from :], final=True)

    def _auto(self) -> list[dict[str, Any]]:
        if self._sent == 0 and _could_be_call(self.text):
            return []
        return self._content_delta(len(self.text))

    def _parse_auto(self) -> bool:
        """Whether the whole text is a call; if so, its name and where its arguments are."""
        text = self.text.strip()
        inner = text[len(OPEN) :] if text.startswith(OPEN) else text
        inner = inner.removesuffix(CLOSE).strip()
        try:
            call = json.loads(inner)
        except ValueError:
            return False
        if not isinstance(call, dict) or call.get("name") not in self.names:
            return False
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict):
            return False
        self.name = call["name"]
        self.text = json.dumps(arguments, ensure_ascii=False)
        self._args_from, self._sent = 0, 0
        self.mode = "named"  # the arguments are the whole text now
        return True

    def _arguments(self, final: bool) -> list[dict[str, Any]]:
        assert self._args_from is not None
        deltas = []
        if not self._started:
            self._started = True
            deltas.append({"tool_calls": [{"index": 0, **self._call("")}]})
        start = max(self._sent, self._args_from)
        shown = self._strip_outer(self.text[self._args_from :], final)
        end = self._args_from + len(shown)
        if end > start:
            piece = self.text[start:end]
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            self._sent = end
        return deltas

    def _strip_outer(self, arguments: str, final: bool) -> str:
        """Without what may be the enclosing object's end (``required``): a trailing run of
        braces and spaces is held until the end, and then its last brace dropped."""
        if self.mode != "required":
            return arguments
        if not final:
            return arguments.rstrip(_CLOSERS) if arguments.endswith(tuple(_CLOSERS)) else arguments
        trimmed = arguments.rstrip()
        return trimmed[:-1].rstrip() if trimmed.endswith("}") else trimmed

    def _content_delta(self, end: int) -> list[dict[str, Any]]:
        piece, self._sent = self.text[self._sent : end], end
        return [{"content": piece}] if piece else []

    def _call(self, arguments: str) -> dict[str, Any]:
        function = {"name": self.name, "arguments": arguments}
        return {"id": self.call_id, "type": "function", "function": function}


def _could_be_call(text: str) -> bool:
    head = text.lstrip()
    return head == "" or head.startswith(("{", OPEN)) or OPEN.startswith(head)
