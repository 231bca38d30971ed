"""Two prompt sets for speculative decoding (``bench speculation``), from the project's own
texts (``bench.assistant_prompts``): ``copy_trace``, tasks whose answers copy runs of a given
text (repeat, correct, quote, extract, edit code), and ``chat_trace``, questions with little
to copy (the support questions under their system prompt, and general ones)."""

from __future__ import annotations

from bench.assistant_prompts import LONG_DOCUMENT, SUPPORT_QUESTIONS, SUPPORT_SYSTEM_PROMPT
from replica.checkpoints.tokenizer import Tokenizer

EDITOR = "You are a careful editor. You change only what you are asked to change."

# the report with five spelling mistakes, for the correcting task
MISSPELT = (
    LONG_DOCUMENT.replace("pitched", "piched")
    .replace("condensation", "condensaton")
    .replace("backpack", "bakpack", 1)
    .replace("recommend", "recomend")
    .replace("minutes", "minuts", 1)
)

CODE = """\
def merge_intervals(intervals):
    intervals = sorted(intervals)
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_length(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))
"""

COPY_TASKS = (
    (EDITOR, "Repeat this report exactly, word for word:\n\n" + LONG_DOCUMENT),
    (EDITOR, "Correct the spelling mistakes in this report and return it in full:\n\n" + MISSPELT),
    (EDITOR, "Copy every sentence of this report that mentions the stove:\n\n" + LONG_DOCUMENT),
    (EDITOR, "Summarise this report, quoting its key sentences:\n\n" + LONG_DOCUMENT),
    (
        "You write Python.",
        "Add type hints to these functions and return the whole code:\n\n" + CODE,
    ),
    ("You write Python.", "Rename merged to result in this code and return it all:\n\n" + CODE),
    (SUPPORT_SYSTEM_PROMPT, "Quote rules 3 and 4 of your instructions exactly."),
    (
        "Answer with the exact words of the text.",
        LONG_DOCUMENT + "\n\nWhat does the report say about the tent? Quote it.",
    ),
)

CHAT_TASKS = (
    *((SUPPORT_SYSTEM_PROMPT, q) for q in SUPPORT_QUESTIONS[:4]),
    ("You are a helpful assistant.", "Write a short poem about the sea in autumn."),
    ("You are a helpful assistant.", "Explain what a hash function is to a child."),
    ("You are a helpful assistant.", "Give me three ideas for a rainy weekend."),
    ("You are a helpful assistant.", "Why is the sky blue? Answer in a paragraph."),
)


def _encode(tokenizer: Tokenizer, system: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.encode_chat(tokenizer.render_chat(messages))


def copy_trace(tokenizer: Tokenizer) -> list[list[int]]:
    return [_encode(tokenizer, s, u) for s, u in COPY_TASKS]


def chat_trace(tokenizer: Tokenizer) -> list[list[int]]:
    return [_encode(tokenizer, s, u) for s, u in CHAT_TASKS]
