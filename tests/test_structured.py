"""Structured outputs in the engine (the tiny random model, byte tokens): every reply held to a
JSON schema parses and validates, a constrained request changes nothing for the unconstrained
ones in its batch, and a constrained request is reproducible in a batch, with n choices,
resumed mid-reply and after preemption; a schema the grammar compiler cannot take is refused
before anything is queued."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import tiny

from replica.checkpoints.tokenizer import ByteTokenizer
from replica.errors import InvalidRequestError
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams, StructuredOutput

TOKENIZER = ByteTokenizer()
# bounded everywhere, so that even a random model completes the object within max_tokens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
HELD = StructuredOutput(kind="json_schema", schema_text=json.dumps(PERSON))
PROMPTS = [TOKENIZER.encode(f"Record {i}: a person.") for i in range(6)]


def params(structured: StructuredOutput | None = HELD, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 120), structured=structured, **kw)


def text(output) -> str:
    return TOKENIZER.decode(output.token_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_reply_is_json_the_schema_accepts(temperature: float) -> None:
    engine = build_engine(tiny(num_blocks=256))
    outputs = engine.generate(PROMPTS, params(temperature=temperature, seed=7))
    for out in outputs:
        assert out.finish_reason == "stop", text(out)
        jsonschema.validate(json.loads(text(out)), PERSON)
    engine.check_invariants(idle=True)


def test_json_object_is_any_object() -> None:
    engine = build_engine(tiny(num_blocks=256))
    spec = StructuredOutput(kind="json_object")
    for out in engine.generate(PROMPTS[:3], params(spec, max_tokens=400, temperature=0.7)):
        if out.finish_reason == "stop":  # a random model may still run out of tokens
            assert isinstance(json.loads(text(out)), dict)
        else:
            assert text(out).startswith("{")


def test_a_constrained_request_changes_nothing_for_the_others_in_its_batch() -> None:
    engine = build_engine(tiny(num_blocks=256))
    free = params(None, max_tokens=40, temperature=0.0)
    alone = engine.generate(PROMPTS[0::2], free)
    mixed = engine.generate(PROMPTS, [free, params(), free, params(), free, params()])
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]


def test_constrained_replies_do_not_depend_on_the_batch_or_the_cache() -> None:
    engine = build_engine(tiny(num_blocks=256))
    seeded = params(temperature=0.9, seed=11)
    alone = [engine.generate([p], seeded)[0].token_ids for p in PROMPTS]
    together = [o.token_ids for o in engine.generate(PROMPTS, seeded)]  # now cached
    assert together == alone


def test_choices_each_follow_the_schema_as_their_own_requests_would() -> None:
    engine = build_engine(tiny(num_blocks=256))
    choices = engine.generate_choices(PROMPTS[0], params(temperature=1.0, seed=3, n=3))
    single = [
        engine.generate([PROMPTS[0]], params(temperature=1.0, seed=3 + i))[0] for i in range(3)
    ]
    assert [c.token_ids for c in choices] == [s.token_ids for s in single]
    for c in choices:
        jsonschema.validate(json.loads(text(c)), PERSON)


def test_a_resumed_request_continues_its_grammar_where_it_was() -> None:
    engine = build_engine(tiny(num_blocks=256))
    whole = engine.generate([PROMPTS[1]], params(temperature=0.8, seed=5))[0].token_ids
    for cut in (1, len(whole) // 2, len(whole) - 1):
        engine.add_request(
            f"resumed-{cut}",
            PROMPTS[1],
            params(temperature=0.8, seed=5),
            output_token_ids=whole[:cut],
        )
        rest = []
        while engine.has_unfinished_requests():
            rest += [t for o in engine.step() for t in o.new_token_ids]
        assert whole[:cut] + rest == whole


def test_preemption_changes_no_constrained_token() -> None:
    roomy = build_engine(tiny(num_blocks=256))
    tight = build_engine(tiny(num_blocks=24, max_num_seqs=6))
    spec = params(temperature=0.0)
    assert [o.token_ids for o in tight.generate(PROMPTS, spec)] == [
        o.token_ids for o in roomy.generate(PROMPTS, spec)
    ]
    assert tight.metrics.preemptions > 0
    tight.check_invariants(idle=True)


def test_a_schema_the_compiler_cannot_take_is_refused_before_anything_is_queued() -> None:
    engine = build_engine(tiny(num_blocks=64))
    lookbehind = {"type": "string", "pattern": "(?<=a)b"}
    bad = StructuredOutput(kind="json_schema", schema_text=json.dumps(lookbehind))
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request("bad", PROMPTS[0], params(bad))
    error = caught.value
    assert error.param == "response_format" and error.code == "invalid_schema"
    assert "Lookbehind" in error.message and ".cc" not in error.message
    assert not engine.has_unfinished_requests()
    engine.check_invariants(idle=True)


def test_a_grammar_is_compiled_once_per_schema() -> None:
    engine = build_engine(tiny(num_blocks=64))
    first = engine.grammars.compile(HELD)
    same = StructuredOutput(kind="json_schema", schema_text=json.dumps(PERSON))
    again = engine.grammars.compile(same)
    assert again is first
