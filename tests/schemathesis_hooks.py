"""The three rules of the API that no JSON Schema can state, taught to schemathesis's
generator.

Every other rule between fields is in the OpenAPI document itself (``cluster.api.formats``:
``if``/``then`` in each body's schema, checked by the server with the same schema), so
schemathesis generates bodies that keep them with no help. Two compare one value of a body
with another, which JSON Schema cannot do (the ``$data`` proposal never became standard):
function names are unique within ``tools``, and a named ``tool_choice`` names one of them.
The third counts tokens: the prompt (the messages and the tools listed in it) must fit the
model's context (a 400 ``context_length_exceeded`` otherwise, as documented). The document
says all three in words; before a generated body is sent, they are made to hold here, and
every other generated value is sent as generated: the server must accept every body the
document allows (``positive_data_acceptance``) and refuse every other. ``before_call``
applies it in every phase (``map_body`` alone leaves the examples and coverage phases out).
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis

# the test cluster's tiny model reads bytes (a token each) in a 4,096-token context, with
# max_tokens at most 64; a body's JSON (ASCII-escaped) is never shorter than its UTF-8 text
PROMPT_BUDGET = 3500


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    case.body = hold_relations(case.body)


def hold_relations(body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    names = []
    for i, tool in enumerate(body.get("tools") or []):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool["function"]["name"] = f"tool_{i}"  # unique
            names.append(tool["function"]["name"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and names:
        choice["function"]["name"] = names[0]  # one of tools
    _fit_context(body)
    return body


def _fit_context(body: dict[str, Any]) -> None:
    """Drop the last tool (then the last message) until the body fits the context; a named
    choice keeps its tool (the first)."""
    while len(json.dumps(body)) > PROMPT_BUDGET:
        tools, messages = body.get("tools"), body.get("messages")
        if isinstance(tools, list) and len(tools) > 1:
            tools.pop()
        elif isinstance(messages, list) and len(messages) > 1:
            messages.pop()
        else:
            return  # one message, one tool: sent as generated
