"""Verified KV blocks moved between two engines (``replica.kv.transfer``): a pulled prefix
is a local hit's equal, and every way a copy can be wrong ends in a miss and a right answer,
with the block accounting of both engines adding up."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from conftest import tiny

from bench.harness.redis_server import LocalRedis
from kvindex.config import IndexConfig
from kvindex.records import RoutingRequest
from kvindex.writer import IndexWriter
from replica.engine.engine import Engine
from replica.kv.transfer import PrefixExport, export_prefix, import_prefix
from replica.messages import EngineRequest, PullRequest
from replica.model.runner import build_engine
from replica.pull import Puller
from replica.pull_config import PullConfig
from replica.sampling.params import SamplingParams

BS = 16
PROMPT = [(7 * i + 3) % 250 for i in range(8 * BS + 5)]  # 8 full blocks and 5 tokens
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def engines(**fields) -> tuple[Engine, Engine]:
    config = tiny(num_blocks=64, **fields)
    return build_engine(config), build_engine(config)


def served(engine: Engine, prompt=PROMPT, salt=None):
    (out,) = engine.generate([prompt], GREEDY, cache_salt=salt)
    engine.check_invariants(idle=True)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pulled_prefix_gives_what_a_local_hit_gives(dtype: str) -> None:
    holder, puller = engines(dtype=dtype)
    first = served(holder)
    export = export_prefix(holder.kv, PROMPT, None)
    assert len(export.blocks) == 8 and export.num_bytes == 8 * holder.runner.kv_cache.data[0].nbytes
    result = import_prefix(puller.kv, PROMPT, None, export)
    assert (result.imported, result.already_held, result.rejected) == (8, 0, [])
    puller.check_invariants(idle=True)
    pulled = served(puller)
    assert pulled.num_cached_tokens == 8 * BS
    local = served(holder)  # the holder's own hit
    alone = served(build_engine(tiny(num_blocks=64, dtype=dtype)))  # nothing cached
    assert pulled.token_ids == local.token_ids == alone.token_ids == first.token_ids


def test_only_the_missing_blocks_are_imported() -> None:
    holder, puller = engines()
    served(holder)
    served(puller, PROMPT[: 3 * BS + 1])  # the puller has the first 3 blocks
    result = import_prefix(puller.kv, PROMPT, None, export_prefix(holder.kv, PROMPT, None))
    assert (result.imported, result.already_held) == (5, 3)
    assert served(puller).num_cached_tokens == 8 * BS


def forged(export: PrefixExport, index: int, **changes) -> PrefixExport:
    blocks = list(export.blocks)
    blocks[index] = replace(blocks[index], **changes)
    return replace(export, blocks=tuple(blocks))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"token_ids": tuple(range(BS))}, "tokens differ"),
        ({"block_hash": b"\0" * 16}, "hash differs"),
        ({"parent_hash": b"\1" * 16}, "parent differs"),
    ],
)
def test_a_wrong_block_ends_the_import_there_and_the_answer_stays_right(change, reason) -> None:
    holder, puller = engines()
    want = served(holder)
    export = forged(export_prefix(holder.kv, PROMPT, None), 5, **change)
    result = import_prefix(puller.kv, PROMPT, None, export)
    assert result.imported == 5 and result.rejected == [f"block 5: {reason}"]
    puller.check_invariants(idle=True)
    got = served(puller)
    assert got.num_cached_tokens == 5 * BS and got.token_ids == want.token_ids


def test_a_torn_copy_is_caught_by_its_checksum() -> None:
    holder, puller = engines()
    want = served(holder)
    export = export_prefix(holder.kv, PROMPT, None)
    kv = export.kv.copy()
    kv[2, kv.shape[1] // 2] ^= 0xFF  # one byte flipped in transit
    result = import_prefix(puller.kv, PROMPT, None, replace(export, kv=kv))
    assert result.imported == 2 and result.rejected == ["block 2: checksum differs"]
    assert served(puller).token_ids == want.token_ids


def test_a_truncated_copy_gives_the_blocks_it_has() -> None:
    holder, puller = engines()
    want = served(holder)
    export = export_prefix(holder.kv, PROMPT, None)
    result = import_prefix(puller.kv, PROMPT, None, replace(export, kv=export.kv[:5]))
    assert result.imported == 5 and result.rejected == ["block 5: truncated"]
    puller.check_invariants(idle=True)
    assert served(puller).token_ids == want.token_ids


def test_blocks_of_another_prompt_under_a_colliding_hash_are_refused() -> None:
    """A collision: another prompt's blocks claiming this prompt's hashes. The receiver
    checks the tokens against its own request, so it takes none of them."""
    holder, puller = engines()
    other = [(t + 1) % 250 for t in PROMPT]
    served(holder, other)
    theirs = export_prefix(holder.kv, other, None)
    mine = build_engine(tiny(num_blocks=64)).block_manager.hasher.chain(PROMPT, None)
    claimed = tuple(
        replace(b, block_hash=mine[i], parent_hash=mine[i - 1] if i else None)
        for i, b in enumerate(theirs.blocks)
    )
    result = import_prefix(puller.kv, PROMPT, None, replace(theirs, blocks=claimed))
    assert result.imported == 0 and result.rejected == ["block 0: tokens differ"]


def test_a_tenants_blocks_go_only_to_a_request_with_its_salt() -> None:
    holder, puller = engines()
    served(holder, salt="tenant-a")
    assert export_prefix(holder.kv, PROMPT, "tenant-b").blocks == ()
    assert export_prefix(holder.kv, PROMPT, None).blocks == ()
    export = export_prefix(holder.kv, PROMPT, "tenant-a")
    assert len(export.blocks) == 8
    # pulled under another salt, the hashes it computes differ: nothing is taken
    assert import_prefix(puller.kv, PROMPT, "tenant-b", export).imported == 0
    assert import_prefix(puller.kv, PROMPT, "tenant-a", export).imported == 8


def test_an_import_takes_only_what_is_free_or_cached_never_a_block_in_use() -> None:
    holder = build_engine(tiny(num_blocks=64))
    served(holder)
    export = export_prefix(holder.kv, PROMPT, None)
    small = build_engine(tiny(num_blocks=12))
    small.add_request("busy", list(range(100, 100 + 9 * BS)), SamplingParams(max_tokens=40))
    small.step()  # 10 blocks in use
    free = small.block_manager.allocator.num_available
    result = import_prefix(small.kv, PROMPT, None, export)
    assert result.imported == free < 8 and result.rejected == [f"room for {free} of 8 blocks"]
    small.check_invariants()
    while small.has_unfinished_requests():
        small.step()
    small.check_invariants(idle=True)


def test_layouts_must_agree() -> None:
    holder = build_engine(tiny(num_blocks=64, dtype="bfloat16"))
    served(holder)
    result = import_prefix(
        build_engine(tiny(num_blocks=64)).kv, PROMPT, None, export_prefix(holder.kv, PROMPT, None)
    )
    assert result.imported == 0 and "layout" in result.rejected[0]


# --- a replica's puller, with a real index and the holder behind a stand-in for Serve's
# handle (the one part a user never touches): what it pulls, and how it gives up ---


class HolderHandle:
    """``handle.export_prefix.remote(pull)`` as Serve routes it to the holder: its answer,
    after ``delay_s``, or the holder's death."""

    def __init__(self, holder: Engine, delay_s: float = 0.0, dead: bool = False) -> None:
        self.holder, self.delay_s, self.dead = holder, delay_s, dead
        self.export_prefix = self

    def remote(self, pull: PullRequest):
        async def answer():
            await asyncio.sleep(self.delay_s)
            if self.dead:
                raise ConnectionError("the holder died")
            return export_prefix(self.holder.kv, pull.prompt_token_ids, pull.cache_salt)

        return answer()


def pull_then_serve(
    redis: LocalRedis, holder: Engine, handle: HolderHandle, index_down: bool = False
):
    """Index the holder's blocks, let a fresh engine's puller act (with Redis stopped first
    when ``index_down``), then serve there."""
    engine = build_engine(tiny(num_blocks=64))
    chain = engine.hasher.chain(PROMPT, None)
    url = redis.url
    writer = IndexWriter(IndexConfig(url=url, cluster="pull"), engine.config.model_id)
    writer.register("holder", "e1")
    writer.publish("holder", "e1", chain)
    if index_down:
        redis.stop()

    async def on_engine(fn, *args):
        return fn(*args)

    config = PullConfig(enabled=True, min_blocks=2, timeout_s=0.5)
    puller = Puller(engine, on_engine, "puller", IndexConfig(url=url, cluster="pull"), config)
    puller._handle = handle
    route = RoutingRequest("r", chain, chain[0], len(PROMPT), BS, max_tokens=12)
    asyncio.run(puller.before_admission(EngineRequest("r", PROMPT, GREEDY, route)))
    return served(engine), puller.counters


def test_a_puller_pulls_what_the_index_says_another_replica_holds(fresh_redis) -> None:
    holder = build_engine(tiny(num_blocks=64))
    want = served(holder)
    got, counters = pull_then_serve(fresh_redis, holder, HolderHandle(holder))
    assert got.num_cached_tokens == 8 * BS and got.token_ids == want.token_ids
    assert (counters.pulls, counters.pulled_blocks, counters.pulls_failed) == (1, 8, 0)
    assert counters.pull_lookups_failed == 0
    assert counters.pulled_bytes == 8 * holder.runner.kv_cache.data[0].nbytes


@pytest.mark.parametrize("handle", ["late", "dead", "evicted"])
def test_a_late_dead_or_emptied_holder_costs_a_recompute(fresh_redis, handle: str) -> None:
    holder = build_engine(tiny(num_blocks=64))
    want = served(holder)
    if handle == "evicted":  # the index still lists blocks the holder no longer has
        holder.reset_prefix_cache()
    stand_in = HolderHandle(holder, delay_s=2.0 if handle == "late" else 0.0, dead=handle == "dead")
    got, counters = pull_then_serve(fresh_redis, holder, stand_in)
    assert got.num_cached_tokens == 0 and got.token_ids == want.token_ids
    assert counters.pulled_blocks == 0
    assert counters.pulls_failed == (handle != "evicted")
    assert counters.pull_lookups_failed == 0


def test_a_lookup_the_index_cannot_answer_is_counted_and_costs_a_recompute(fresh_redis) -> None:
    """Redis is down when the puller asks who holds the prompt: no pull is tried (nothing
    says where the blocks are), the request recomputes them, and the lookup is counted,
    apart from pulls that were tried and failed."""
    holder = build_engine(tiny(num_blocks=64))
    want = served(holder)
    got, counters = pull_then_serve(fresh_redis, holder, HolderHandle(holder), index_down=True)
    assert got.num_cached_tokens == 0 and got.token_ids == want.token_ids
    assert (counters.pulls, counters.pulls_failed, counters.pull_lookups_failed) == (0, 0, 1)
