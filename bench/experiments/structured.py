"""``structured``: what holding replies to a JSON schema costs the engine.

One engine (the served model and dtype, ``--threads``), a batch of ``--batch`` chat prompts
decoding ``--tokens`` tokens each, EOS ignored, greedy, prefix cache emptied before every run:
all free, a mix (every other request held to a JSON schema), and all held. Output tokens/s
of each, the runs alternated (A B C C B A ...) and repeated; medians with min and max, and
each run's ratio to the all-free run beside it. A held request ends when its schema does
(``ignore_eos`` cannot keep it going), and a batch that shrinks runs slower for that alone;
so the schema is an object whose one string has at least 4,000 characters, which no reply
reaches in ``--tokens`` tokens: every run decodes the same number of tokens, and the
difference is the mask's cost (building it, applying it, advancing the matcher).

Also the first-request costs on a fresh engine: building the grammar vocabulary from the
tokenizer (once per replica), compiling a schema the first time, and the cached lookup.

And what the model does with ``tool_choice: auto`` (``--auto-prompts``): chat requests with
two tools listed, half of them asking for what a tool does (weather, a unit conversion) and
half small talk, greedy, rendered and read back exactly as the server does
(``cluster.api.tools``): how many of each came back as a call, and how many calls named a
tool with arguments its schema accepts.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jsonschema
import torch

from bench.experiments.speed import workload
from bench.report import spread
from cluster.api.models import ChatCompletionRequest
from cluster.api.tools import ToolCallStream, template_messages, template_tools
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams, StructuredOutput

# no reply completes it in --tokens tokens, so a held request runs as long as a free one
LONG_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
}
RECORD = {  # a typical extraction schema, for the compile times
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "churned"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "email", "age"],
    "additionalProperties": False,
}
MIXES = ("free", "mixed", "held")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_units",
            "description": "Convert a quantity from one unit to another",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number"},
                    "from_unit": {"type": "string"},
                    "to_unit": {"type": "string"},
                },
                "required": ["value", "from_unit", "to_unit"],
            },
        },
    },
]
TOOL_ASKS = [
    "What is the weather in Paris right now?",
    "How many kilometers is 26 miles?",
    "Is it raining in Tokyo?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "What's the temperature in Lisbon today?",
]
SMALL_TALK = [
    "Hi! How are you today?",
    "Tell me a short joke.",
    "What is the capital of Spain?",
    "Write one sentence about cats.",
    "Thank you for your help.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--auto-prompts", type=int, default=20, help="tool_choice auto requests")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    checkpoint = checkpoint_for(args.model)
    prompts = workload(checkpoint.tokenizer(), 16, [args.batch])["chats"]
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        num_blocks=2048,
        max_num_seqs=args.batch,
        max_num_batched_tokens=512,
    )
    result: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    result["first_request"] = _first_request_costs(config)
    engine = build_engine(config)
    held = StructuredOutput(kind="json_schema", schema_text=json.dumps(LONG_TEXT))
    free = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    constrained = free.model_copy(update={"structured": held})
    mixes = {
        "free": [free] * args.batch,
        "mixed": [free if i % 2 else constrained for i in range(args.batch)],
        "held": [constrained] * args.batch,
    }
    engine.generate(prompts[:2], [free, constrained])  # warm: kernels, the grammar compiled
    rates: dict[str, list[float]] = {mix: [] for mix in MIXES}
    for rep in range(args.repeats):
        for mix in MIXES if rep % 2 == 0 else MIXES[::-1]:
            engine.reset_prefix_cache()
            start = time.perf_counter()
            outputs = engine.generate(prompts, mixes[mix])
            tokens = sum(len(o.token_ids) for o in outputs)
            assert tokens == len(prompts) * args.tokens, "a reply ended early"
            rates[mix].append(tokens / (time.perf_counter() - start))
    for mix in MIXES:
        result[f"output_tokens_per_s_{mix}"] = spread(rates[mix])
        ratios = [a / b for a, b in zip(rates[mix], rates["free"], strict=True)]
        result[f"{mix}_over_free"] = spread(ratios)
    result["auto_tool_calls"] = _auto_tool_calls(engine, checkpoint.tokenizer(), args.auto_prompts)
    result["conditions"] = {"batch": args.batch, "tokens": args.tokens, "repeats": args.repeats}
    return result


def _auto_tool_calls(engine: Engine, tokenizer: Any, count: int) -> dict[str, Any]:
    """Of ``count`` chat requests with tools and ``tool_choice: auto`` (half asking for a
    tool's job, half not), how many the server would answer as a call, and how many valid."""
    asks = [(q, True) for q in TOOL_ASKS] + [(q, False) for q in SMALL_TALK]
    asks = [asks[i % len(asks)] for i in range(count)] if count else []
    bodies = [
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": q}], "tools": TOOLS}
        )
        for q, _ in asks
    ]
    prompts = [
        tokenizer.encode_chat(
            tokenizer.render_chat(
                template_messages(b, tokenizer.template_has_tools), template_tools(b)
            )
        )
        for b in bodies
    ]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0))
    counts = {"tool_asks": 0, "tool_asks_called": 0, "small_talk": 0, "small_talk_called": 0}
    valid = 0
    for (_, wants_tool), body, out in zip(asks, bodies, outputs, strict=True):
        stream = ToolCallStream("auto", body.tools or [])
        stream.push(tokenizer.decode(out.token_ids))
        stream.finish()
        key = "tool_asks" if wants_tool else "small_talk"
        counts[key] += 1
        if stream.is_call:
            counts[f"{key}_called"] += 1
            valid += _valid_call(stream)
    return {**counts, "calls_with_valid_arguments": valid}


def _valid_call(stream: ToolCallStream) -> bool:
    schema = next(
        t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == stream.name
    )
    try:
        jsonschema.validate(json.loads(stream.arguments), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _first_request_costs(config: EngineConfig) -> dict[str, float]:
    """Seconds a fresh engine spends before its first held request: the grammar vocabulary
    (once per replica), then the schema's compile, then the cached lookup."""
    engine = build_engine(config)
    spec = StructuredOutput(kind="json_schema", schema_text=json.dumps(RECORD))
    start = time.perf_counter()
    engine.grammars.compile(StructuredOutput(kind="json_object"))
    vocabulary = time.perf_counter() - start
    start = time.perf_counter()
    engine.grammars.compile(spec)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.grammars.compile(spec)
    cached = time.perf_counter() - start
    return {"vocabulary_and_json_object_s": vocabulary, "compile_s": compile_s, "cached_s": cached}
