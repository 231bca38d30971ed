"""torch.compile / zentorch over our engine's step, measured with the ``speed`` jobs (ABBA).

A one-off trial (docs/decisions.md), not a benchmark we keep running. zentorch is not a
dependency: ``pip install --target /tmp/ztpkg --no-deps zentorch==2.13.0.2 deprecated wrapt``.

    PYTHONPATH=.:/tmp/ztpkg .venv/bin/python docs/trials/compile_trial.py \
        ours,inductor,plain,plain-zentorch > results/compile-trial.json
"""

import json
import sys
import time

import torch

import replica.model.runner as runner_mod
from bench.experiments import speed
from bench.report import spread
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.engine import EngineConfig
from replica.model import kernels

kernels.load()
lib = "prefix_serve::"
torch.library.register_fake(lib + "paged_attention")(lambda q, *a: torch.empty_like(q))
torch.library.register_fake(lib + "write_kv")(lambda *a: None)
torch.library.register_fake(lib + "rms_norm")(lambda x, w, e: torch.empty_like(x))
torch.library.register_fake(lib + "add_rms_norm")(lambda r, x, w, e: torch.empty_like(x))
torch.library.register_fake(lib + "silu_mul")(
    lambda g: g.new_empty((*g.shape[:-1], g.shape[-1] // 2))
)
torch.library.register_fake(lib + "rope")(lambda *a: None)
torch.library.register_fake(lib + "linear")(lambda x, p, n, v=True: x.new_empty((*x.shape[:-1], n)))

variants = sys.argv[1].split(",")
batches = [1, 8, 32]
torch.set_num_threads(2)
ck = checkpoint_for(SMOLLM2)
prompts = speed.workload(ck.tokenizer(), 1024, batches)
warm = prompts["chats"][0]
cfg = EngineConfig(
    model=SMOLLM2,
    dtype="bfloat16",
    num_threads=2,
    num_blocks=2048,
    max_num_seqs=32,
    max_num_batched_tokens=512,
    deterministic=True,
)
peers = {}
orig_pack = runner_mod.pack_linears
for v in variants:
    runner_mod.pack_linears = orig_pack if "plain" not in v else (lambda m, kernel: 0)
    t0 = time.time()
    peer = speed.EnginePeer.__new__(speed.EnginePeer)
    from replica.engine import Engine, SamplingParams

    peer.engine = Engine(cfg)
    r = peer.engine._runner if hasattr(peer.engine, "_runner") else None
    # find the runner
    for name in ("runner", "_runner", "model_runner"):
        if hasattr(peer.engine, name):
            r = getattr(peer.engine, name)
    assert r is not None, dir(peer.engine)
    if "inductor" in v:
        import torch._inductor.config as ic

        ic.freezing = "freeze" in v
        ic.cpp_wrapper = "cppw" in v
        r.model = torch.compile(r.model, dynamic=True)
    if "zentorch" in v:
        import zentorch  # noqa

        r.model = torch.compile(r.model, backend="zentorch", dynamic=True)
    peer.engine.generate([warm], SamplingParams(max_tokens=4))
    for b in batches:  # compile every shape once before timing
        peer.engine.generate(prompts["chats"][:b], SamplingParams(max_tokens=3, ignore_eos=True))
    print(v, "ready in", round(time.time() - t0, 1), file=sys.stderr, flush=True)
    peers[v] = peer
jobs = speed._jobs(prompts, batches, 64)
times = speed._alternate(peers, jobs, 2)
out = {
    v: {c: spread(x) for c, x in speed._rates(times[v], prompts, batches, 64).items()}
    for v in variants
}
print(json.dumps(out, indent=1))
