"""OpenAI request bodies to engine requests: what the model allows, the sampling parameters,
the cache salt, and the block hashes the router reads (hashed once, here)."""

from __future__ import annotations

import secrets
import uuid

from fastapi import Request

from cluster import sessions
from cluster.api.errors import APIError
from cluster.api.models import ChatCompletionRequest, CompletionRequest
from cluster.api.structured import structured_output
from cluster.config import ClusterArgs
from cluster.tenants import Tenant, Tenants, bearer_key
from kvindex.hashing import BlockHasher
from kvindex.records import RoutingRequest
from replica.messages import EngineRequest, Owner, Retention
from replica.sampling.params import SamplingParams

Body = CompletionRequest | ChatCompletionRequest


class RequestBuilder:
    def __init__(self, args: ClusterArgs, hasher: BlockHasher) -> None:
        self.args = args
        self.hasher = hasher
        self.tenants = Tenants(args.api_keys)
        self.model_id = args.engine.model_id
        self.vocab = args.engine.shape.vocab_size

    def build(
        self,
        body: Body,
        request: Request,
        prompts: list[tuple[list[int], str]],
        max_tokens: int,
    ) -> list[EngineRequest]:
        """An engine request per prompt (ids, text), or the API error that says why there is
        none: every prompt is checked before any is sent."""
        if body.model != self.model_id:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist; this server serves '{self.model_id}'",
                code="model_not_found",
                param="model",
            )
        for ids, _ in prompts:
            self._check_lengths(body, ids, max_tokens)
        tenant = self.tenant(request)
        salt = self.cache_salt(body, request, tenant)
        params = self.sampling_params(body, max_tokens)
        keep = self.retention(body, request, tenant) if len(prompts) == 1 else None
        owner = Owner(tenant.name, tenant.weight, tenant.priority)
        return [self._engine_request(ids, text, params, salt, keep, owner) for ids, text in prompts]

    def tenant(self, request: Request) -> Tenant:
        """Who sent it (``cluster.tenants``)."""
        return self.tenants.of(
            bearer_key(request.headers.get("authorization", "")), request.headers
        )

    def retention(self, body: Body, request: Request, tenant: Tenant) -> Retention | None:
        """What of the request's blocks to keep for its session (``cluster.sessions``)."""
        asked = body.cache_retention.ttl_s if body.cache_retention is not None else None
        return sessions.retention(self.args.sessions, tenant, request.headers, asked)

    def _engine_request(
        self,
        ids: list[int],
        text: str,
        params: SamplingParams,
        salt: str | None,
        retention: Retention | None,
        owner: Owner,
    ) -> EngineRequest:
        chain = self.hasher.chain(ids, salt)
        request_id = uuid.uuid4().hex
        route = RoutingRequest(
            request_id=request_id,
            block_hashes=chain,
            affinity_key=self.hasher.affinity_key(ids, self.args.affinity_blocks, salt, chain),
            num_prompt_tokens=len(ids),
            block_size=self.hasher.block_size,
            max_tokens=params.max_tokens,
        )
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            route=route,
            cache_salt=salt,
            prompt=text,
            retention=retention,
            owner=owner,
        )

    def sampling_params(self, body: Body, max_tokens: int) -> SamplingParams:
        bias = {int(t): b for t, b in (body.logit_bias or {}).items()}
        stop_ids = body.stop_token_ids or []
        if any(t >= self.vocab for t in bias) or any(not 0 <= t < self.vocab for t in stop_ids):
            raise APIError(400, f"token ids must be in [0, {self.vocab})", param="logit_bias")
        structured = structured_output(body)  # min_tokens with it: cluster.api.rules
        if isinstance(body, CompletionRequest):
            logprobs, prompt_logprobs = body.logprobs, body.logprobs if body.echo else None
        else:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs = None
        return SamplingParams(
            max_tokens=max(max_tokens, 1),  # echo with max_tokens 0 scores the prompt only
            temperature=body.temperature,
            top_p=body.top_p,
            # a seed of its own, so a stream resumed on another replica samples the same
            seed=body.seed if body.seed is not None else secrets.randbits(62),
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(stop_ids),
            n=body.n,
            min_tokens=min(body.min_tokens, max_tokens),  # at least max_tokens: exactly that
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            speculate=body.speculation,
        )

    def cache_salt(self, body: Body, request: Request, tenant: Tenant | None = None) -> str | None:
        """The client's salt (body, or ``x-cache-salt``); with API keys, also the tenant's
        (``cluster.tenants``: a plain key is a tenant of its own), so users of one tenant
        share cached prefixes and different tenants never do (unless the operator shares
        them across keys)."""
        salt = body.cache_salt or request.headers.get("x-cache-salt") or None
        if not self.args.api_keys or self.args.share_cache_across_keys:
            return salt
        tenant = tenant or self.tenant(request)
        return tenant.name + (f"/{salt}" if salt else "")

    def _check_lengths(self, body: Body, ids: list[int], max_tokens: int) -> None:
        limit = self.args.max_tokens_limit
        lowest = 0 if isinstance(body, CompletionRequest) else 1
        # a chat body's max_tokens is checked even where max_completion_tokens overrides it
        if not lowest <= max_tokens <= limit or (body.max_tokens or 0) > limit:
            raise APIError(400, f"max_tokens must be in [{lowest}, {limit}]", param="max_tokens")
        context = self.args.engine.context_len
        if len(ids) + max(max_tokens, 1) > context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens; "
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}",
                code="context_length_exceeded",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
