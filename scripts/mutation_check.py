"""Break each rule the README states, one at a time, in a copy of the tree, and run the test
named to hold it: every mutation must make that test fail on an assertion.

    .venv/bin/python scripts/mutation_check.py      # a few minutes on 2 cores

First the named tests run on the unmutated tree and must pass (else nothing below means
anything). Then each mutation: caught only when its named test fails with an assertion
error; a crash, an import error, a timeout or a pass is not caught. Each run is time-boxed.
Last, the README's table must list exactly these mutations, each with its named test.
Prints one line per mutation; exits 1 if any is not caught or the table disagrees.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
NEWEST = "victim = max([seq, *pending], key=lambda s: order[id(s)])"
PARENT = "test_block_manager.py::test_a_hit_needs_its_parent_to_be_the_block_matched_just_before"
PREEMPT = (
    "test_scheduler.py::"
    "test_preemption_mid_chunk_takes_the_newest_and_it_resumes_from_its_cached_blocks"
)
RULES = "test_rules.py::"
# (what the mutation breaks, file, text replaced, its replacement, the test that must fail)
MUTATIONS = [
    ("lookup without the parent check", "replica/engine/blocks/prefix_cache.py",
     "and e.parent in level\n", "\n", PARENT),
    ("preemption takes the oldest", "replica/engine/scheduler.py",
     NEWEST, NEWEST.replace("max", "min"), PREEMPT),
    ("preemption takes the one needing the block", "replica/engine/scheduler.py",
     NEWEST, "victim = seq", PREEMPT),
    ("cached blocks not available (preempt before evicting)",
     "replica/engine/blocks/allocator.py",
     "return len(self._free) + self.num_cached", "return len(self._free)", PREEMPT),
    ("temperature ignored", "replica/sampling/sampler.py",
     "torch.softmax(logits / row.params.temperature, dim=-1)", "torch.softmax(logits, dim=-1)",
     RULES + "test_temperature_divides_the_logits"),
    ("a presence penalty alone skips processing", "replica/sampling/logits_processing.py",
     "        or params.presence_penalty\n", "",
     RULES + "test_each_penalty_alone_turns_greedy_away_from_a_repeated_token"),
    ("a resumed request's delivered tokens counted as prompt", "replica/engine/engine.py",
     "        seq.num_prompt_tokens = len(tokens)\n", "",
     RULES + "test_a_resumed_request_counts_its_delivered_tokens_as_output"),
    ("a booking never released", "router/core.py",
     "return self.bookings.release(request_id, replica_id)",
     "return self.bookings._by_request.get(request_id)",
     RULES + "test_a_released_booking_leaves_no_load_behind"),
    ("a released booking's load not subtracted", "router/bookings.py",
     "            self._totals[booking.replica_id] -= _load(booking)", "            pass",
     RULES + "test_a_released_booking_leaves_no_load_behind"),
    ("the router does not record where it sent a prefix", "router/core.py",
     "            self.recent.record(replica_id, request.block_hashes)", "            pass",
     RULES + "test_the_router_records_where_it_sent_a_prefix_for_when_the_index_is_late"),
    ("with API keys, the client's own cache_salt dropped", "cluster/request_builder.py",
     'return f"key:{key_id}" + (f"/{salt}" if salt else "")', 'return f"key:{key_id}"',
     RULES + "test_with_api_keys_a_requests_salt_has_its_key_and_its_own_salt"),
    ("a resumed request rehashed without its salt", "cluster/engine_stream.py",
     "prompt_token_ids + delivered, self.request.cache_salt)",
     "prompt_token_ids + delivered, None)",
     RULES + "test_a_resumed_stream_is_rehashed_under_its_salt"),
    ("the index's breaker trips after 1 failure, not 3", "kvindex/reader.py",
     "TRIP_AFTER_FAILURES = 3", "TRIP_AFTER_FAILURES = 1",
     RULES + "test_the_index_breaker_trips_after_three_failed_queries_in_a_row"),
    ("an evicted block keeps its generation", "replica/engine/blocks/allocator.py",
     "        self.generations[block] += 1\n", "",
     "test_shared_pool.py::test_a_block_evicted_after_the_export_ends_the_import_there"),
    ("a block pulled by reference is not checked after its copy",
     "replica/kv/shared_pool.py",
     "if after[sources[i]] != generations[i]:", "if False:",
     "test_shared_pool.py::"
     "test_a_block_reused_mid_copy_is_refused_even_after_its_bytes_arrived"),
    ("the index's log leaves evictions out", "kvindex/scripts.py",
     "if #ARGV > 5 + n_stored then emit(", "if false then emit(",
     "test_index_mirror.py::test_the_mirror_answers_what_redis_answers_after_random_changes"),
    ("a mirror counts its own router's shared bookings", "kvindex/mirror/state.py",
     "        if router == self.own_router:\n            return\n", "",
     "test_index_mirror.py::test_routers_see_each_others_shared_bookings_until_they_lapse"),
    ("a mirror's answer leaves the other routers' shares out", "kvindex/mirror/state.py",
     "np.take((self.loads + self.shared).T, slots, axis=1)", "np.take(self.loads.T, slots, axis=1)",
     "test_index_mirror.py::test_routers_see_each_others_shared_bookings_until_they_lapse"),
    ("the holder table does not count a block's second holder",
     "kvindex/mirror/holder_table.py",
     "        self.shared[key] = (1 << holder) | bit\n        self.count[slot] += 1\n",
     "        self.shared[key] = (1 << holder) | bit\n",
     "test_holder_table.py::"
     "test_the_table_holds_what_a_dict_of_sets_holds_after_random_changes"),
    ("the admission cap ignores the engine replicas Serve runs", "cluster/admission.py",
     "        if count and count != self._count:", "        if False:",
     "test_admission.py::test_the_cap_follows_the_engine_replicas_serve_runs"),
    ("a choice forks from a parent already released", "replica/engine/blocks/manager.py",
     "        if not parent.block_table:  # released", "        if False:  # released",
     "test_block_manager.py::"
     "test_a_released_sequence_holds_nothing_and_a_fork_of_it_is_refused"),
    ("an imported or restored block's tokens not compared", "replica/kv/transfer.py",
     'else "tokens differ" if block.token_ids != tokens', 'else "tokens differ" if False',
     "test_store_tier.py::test_a_forged_block_under_the_right_hash_is_refused"),
    ("a node store's fingerprint leaves the secret out", "replica/store/layout.py",
     "text + secret_digest, digest_size=16", "text, digest_size=16",
     "test_node_store.py::test_sweep_removes_unused_stores_no_replica_here_can_use"),
    ("a restore hashes the prompt without its salt", "replica/store/tier.py",
     "prompt, salt = seq.token_ids[: usable * bs], seq.cache_salt",
     "prompt, salt = seq.token_ids[: usable * bs], None",
     "test_store_tier.py::test_a_tenants_stored_blocks_go_only_to_its_own_salt"),
    ("the router leaves the node store's run uncredited", "router/core.py",
     "            extra = np.maximum(extra, stored_token_column(request, table))",
     "            pass",
     "test_store_pricing.py::"
     "test_the_router_prefers_a_replica_that_restores_over_one_that_recomputes"),
    ("a hit block is not protected from one-off prompts", "replica/engine/blocks/allocator.py",
     "        self._hit[block] = 1\n", "        pass\n",
     "test_eviction.py::test_a_prompt_seen_once_is_evicted_before_a_prefix_that_was_hit"),
    ("protected blocks beyond the cap demoted newest first", "replica/engine/blocks/allocator.py",
     "self._protected.popitem(last=False)", "self._protected.popitem(last=True)",
     "test_eviction.py::"
     "test_protected_blocks_beyond_the_cap_go_back_on_probation_least_recent_first"),
    ("a queued request's prefix is not made the most recent", "replica/engine/engine.py",
     "        self.block_manager.expect(seq)", "        pass",
     "test_engine.py::test_a_queued_request_still_hits_the_prefix_it_was_sent_for[True]"),
    ("a queued prefix is touched parents first", "replica/engine/blocks/allocator.py",
     "        for block in reversed(chain):", "        for block in chain:",
     "test_eviction.py::"
     "test_expecting_a_prefix_moves_only_cached_blocks_and_changes_no_flag"),
    ("a new prefix's load leaves out the holder's lead", "router/prefill_cost.py",
     "load = costs + credits - lead_credit(request, kept)", "load = costs + credits",
     "test_policies.py::test_a_prompt_whose_tail_was_evicted_keeps_its_lead_beyond_a_shared_head"),
    ("a lead over replicas keeping nothing is credited", "router/prefill_cost.py",
     "    if top > second > 0:", "    if top > second:",
     "test_policies.py::test_a_prompt_whose_tail_was_evicted_keeps_its_lead_beyond_a_shared_head"),
]  # fmt: skip
ASSERTION = re.compile(r"^E\s+(AssertionError|assert )", re.M)


def run_test(tree: Path, test: str) -> tuple[str, str]:
    """(outcome, detail): passed, failed (on an assertion), crashed, or timed out."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"tests/{test}"]
    try:
        run = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return "timed out", f"over {TIMEOUT_S} s"
    if run.returncode == 0:
        return "passed", ""
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    if run.returncode == 1 and failed and ASSERTION.search(run.stdout):
        return "failed", failed[0]
    return "crashed", f"exit {run.returncode}: {run.stdout[-300:]}"


def mutated_copy(tmp: Path, path: str, old: str, new: str) -> Path:
    copy = tmp / "tree"
    skip = shutil.ignore_patterns(".venv*", ".git", "results", "mutants", "*.egg-info")
    shutil.copytree(REPO, copy, ignore=skip)
    source = copy / path
    text = source.read_text()
    assert text.count(old) == 1, f"{path}: the mutated text must occur exactly once"
    source.write_text(text.replace(old, new))
    return copy


def table_agrees() -> bool:
    """The README's table: one row per mutation, naming its test."""
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (.+?) \| `([^`]+)` \|$", readme, re.M)
    listed = {name: test for name, test in rows if "::" in test}
    wanted = {name: test for name, _, _, _, test in MUTATIONS}
    if listed != wanted:
        print(f"README table differs: {sorted(set(listed.items()) ^ set(wanted.items()))}")
    return listed == wanted


def main() -> None:
    for test in sorted({m[-1] for m in MUTATIONS}):  # the unmutated tree passes them all
        outcome, detail = run_test(REPO, test)
        assert outcome == "passed", f"unmutated tree: {test} {outcome} {detail}"
    missed = 0
    for name, path, old, new, test in MUTATIONS:
        with tempfile.TemporaryDirectory() as tmp:
            outcome, detail = run_test(mutated_copy(Path(tmp), path, old, new), test)
        caught = outcome == "failed"
        missed += not caught
        print(f"{'caught' if caught else outcome.upper()}: {name}: {detail}", flush=True)
    sys.exit(1 if missed or not table_agrees() else 0)


if __name__ == "__main__":
    main()
