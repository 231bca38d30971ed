"""vLLM's async engine behind this project's request and output records.

The ingress tokenizes (the model folder's own tokenizer and chat template) and hashes the
prompt; vLLM gets the token ids themselves (``TokensPrompt``), so what it caches is keyed by
exactly the ids the router hashed. Its KV events go to two local sockets
(``ipc://`` in ``events_dir``: the publisher binds, only this replica subscribes).

What carries over from the native engine and what does not (README, "Serving vLLM
replicas"): a request resumed after a replica died is sent again as prompt + the tokens
already delivered, as with the native engine, but vLLM's batches are not row-invariant and
its seeded sampling depends on the batch, so the continuation is not token-exact; ``n`` > 1
samples vLLM's way (not as ``n`` requests seeded ``seed + i``).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm import SamplingParams as VLLMSamplingParams
from vllm.config import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.logprobs import Logprob, SampleLogprobs
from vllm.outputs import RequestOutput as VLLMOutput
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM

from replica.config import EngineConfig
from replica.messages import EngineRequest, RequestOutput
from replica.sampling.params import SamplingParams, TokenLogprob
from replica.vllm.args import vllm_kwargs


@dataclass(frozen=True)
class EventEndpoints:
    """Where this replica's vLLM publishes its KV events and answers replays."""

    publish: str
    replay: str

    @classmethod
    def in_dir(cls, folder: Path) -> EventEndpoints:
        return cls(f"ipc://{folder}/kv-events", f"ipc://{folder}/kv-replay")


def engine_args(config: EngineConfig, endpoints: EventEndpoints) -> AsyncEngineArgs:
    """``EngineConfig`` in vLLM's words (``VLLM_KWARGS_OURS`` lists what it sets)."""
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoints.publish,
        replay_endpoint=endpoints.replay,
        buffer_steps=config.vllm.events_replay_buffer,
    )
    return AsyncEngineArgs(**vllm_kwargs(config), kv_events_config=events)


def vllm_params(params: SamplingParams, eos: tuple[int, ...], delivered: int) -> VLLMSamplingParams:
    """Our sampling parameters for vLLM; ``delivered`` tokens were already sent (a resume)."""
    structured = None
    if params.structured is not None:
        if params.structured.schema_text is None:
            structured = StructuredOutputsParams(json_object=True)
        else:
            structured = StructuredOutputsParams(json=json.loads(params.structured.schema_text))
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
    return VLLMSamplingParams(
        n=params.n,
        max_tokens=params.max_tokens - delivered,
        min_tokens=max(0, params.min_tokens - delivered),
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        stop_token_ids=stops,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) or None,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )


def _logprob(token: int, position: dict[int, Logprob], k: int) -> TokenLogprob:
    """One position of vLLM's (the sampled token and the ``k`` most likely, ranked)."""
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank <= k)
    return TokenLogprob(token, position[token].logprob, tuple((t, lp) for _, t, lp in top))


def _logprobs(tokens: list[int], given: SampleLogprobs | None, k: int) -> list[TokenLogprob] | None:
    if given is None:
        return None
    return [_logprob(t, position, k) for t, position in zip(tokens, given, strict=True)]


@dataclass
class VLLMCounters:
    """The engine's counters, named as ``replica.engine.stats.EngineStats`` names them."""

    num_finished: int = 0
    num_aborted: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0

    def stats(self, running: int, blocks_total: int, blocks_cached: int, evictions: int) -> dict:
        """The native engine's stats names (``EngineStats``), filled with what vLLM's
        outputs and events tell; what only vLLM's scheduler knows (its queue, its steps,
        its free blocks) is None."""
        hit = self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {
            **asdict(self),
            "num_running": running,
            "num_waiting": None,
            "hit_rate": hit,
            "computed_tokens": self.prompt_tokens
            - self.cached_prompt_tokens
            + self.generation_tokens,
            "preemptions": None,
            "evictions": evictions,
            "hash_mismatches": 0,  # vLLM verifies nothing: its hits are by hash alone
            "steps": None,
            "blocks_total": blocks_total,
            "blocks_free": None,
            "blocks_cached": blocks_cached,
            "blocks_in_use": None,
            "ttft_p50_s": None,
            "ttft_p99_s": None,
            "itl_p50_s": None,
        }


class VLLMEngine:
    """One vLLM ``AsyncLLM`` (its engine core and worker are child processes)."""

    def __init__(self, config: EngineConfig, endpoints: EventEndpoints) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.vllm.kv_cache_gib))
        self.config = config
        self.eos = tuple(config.shape.eos_token_ids)
        self.counters = VLLMCounters()
        self.llm = AsyncLLM.from_engine_args(engine_args(config, endpoints))
        cache = self.llm.vllm_config.cache_config
        self.num_blocks = int(cache.num_gpu_blocks or config.num_blocks)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs, one per vLLM step that gave it tokens."""
        delivered = request.output_token_ids
        prompt = TokensPrompt(prompt_token_ids=[*request.prompt_token_ids, *delivered])
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        params = vllm_params(request.params, self.eos, len(delivered))
        sofar: dict[int, list[int]] = {}
        first = True
        async for out in self.llm.generate(prompt, params, request.request_id):
            for output in self._convert(request, out, sofar, first):
                yield output
            first = False

    def _convert(
        self, request: EngineRequest, out: VLLMOutput, sofar: dict[int, list[int]], first: bool
    ) -> list[RequestOutput]:
        cached = out.num_cached_tokens or 0
        prompt_len = len(request.prompt_token_ids)
        if first:
            self.counters.prompt_tokens += prompt_len
            self.counters.cached_prompt_tokens += cached
        outputs = []
        for choice in out.outputs:
            new = list(choice.token_ids)
            tokens = sofar.setdefault(choice.index, [])
            tokens += new
            self.counters.generation_tokens += len(new)
            finished = choice.finish_reason is not None
            if finished:
                self.counters.num_finished += 1
                self.counters.num_aborted += choice.finish_reason == "abort"
            outputs.append(
                RequestOutput(
                    request.request_id,
                    new,
                    tokens,
                    finished,
                    choice.finish_reason,  # vLLM's names are ours: stop, length, abort
                    prompt_len,
                    cached,
                    index=choice.index,
                    logprobs=_logprobs(new, choice.logprobs, request.params.logprobs or 0),
                    prompt_logprobs=_prompt_logprobs(request, out) if first else None,
                )
            )
        return outputs

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        return await self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        self.llm.shutdown()


def _prompt_logprobs(request: EngineRequest, out: VLLMOutput) -> list[TokenLogprob | None] | None:
    """The prompt's logprobs (the first position has none), on the first output only."""
    k = request.params.prompt_logprobs
    if k is None or out.prompt_logprobs is None:
        return None
    ids = request.prompt_token_ids
    rest = [_logprob(t, p, k) for t, p in zip(ids[1:], out.prompt_logprobs[1:], strict=True) if p]
    return [None, *rest]
