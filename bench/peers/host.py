"""This host as the benchmarks see it: the commit and CPU a run measured (``provenance``,
in every ``speed`` and ``stack`` result), its physical cores, and what a vLLM process is
given on it (``vllm_env``), as vLLM's CPU documentation asks
(https://docs.vllm.ai/en/latest/getting_started/installation/cpu/, "set LD_PRELOAD" and
"How to decide VLLM_CPU_OMP_THREADS_BIND"):

* TCMalloc and Intel OpenMP in ``LD_PRELOAD``, in that order: Debian's
  ``libtcmalloc_minimal.so.4`` (``ensure_tcmalloc`` installs ``libtcmalloc-minimal4``, as
  the setup step installs vLLM's virtualenv) and the ``libiomp5.so`` that ``vllm-cpu``
  brings (``intel-openmp``, in the virtualenv's ``lib/``). ``vllm-cpu`` 0.32 bundles
  neither, and sets ``LD_PRELOAD`` only for the processes it spawns: too late for an
  engine running in the process itself, as ``vllm_worker.py``'s does.
* Its OpenMP threads bound one per physical core (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's
  default, ``auto``, binds every core of the NUMA node, whatever thread count the
  benchmark gives the other engines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TCMALLOC, TCMALLOC_PACKAGE = "libtcmalloc_minimal.so.4", "libtcmalloc-minimal4"  # Debian's
PRELOADS = ("tcmalloc", "iomp5")  # vLLM's docs: TCMalloc first, then Intel OpenMP
CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def _find_library(name: str) -> Path | None:
    """Where the dynamic linker finds ``name`` (``ldconfig -p``), or None."""
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False)
    for line in listing.stdout.splitlines():
        soname, _, path = line.strip().partition(" => ")
        if soname.split(" ")[0] == name and Path(path).exists():
            return Path(path)
    return None


def ensure_tcmalloc() -> Path:
    """Debian's TCMalloc, installed with apt-get when missing (sudo unless root), as
    ``make install`` installs redis-server: vLLM's CPU docs ask for it preloaded."""
    found = _find_library(TCMALLOC)
    if found is None and shutil.which("apt-get"):
        sudo = [] if os.getuid() == 0 else ["sudo"]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run([*sudo, "apt-get", "update", "-qq"], env=env, check=False)
        install = [*sudo, "apt-get", "install", "-y", "-qq", TCMALLOC_PACKAGE]
        subprocess.run(install, env=env, check=False, stdout=subprocess.DEVNULL)
        found = _find_library(TCMALLOC)
    if found is None:
        raise RuntimeError(f"no {TCMALLOC}: install {TCMALLOC_PACKAGE}, or pass --vllm-preload ''")
    return found


def vllm_preload(python: Path, which: Iterable[str] = PRELOADS) -> list[str]:
    """The libraries to preload into vLLM run by ``python``: Debian's TCMalloc and the Intel
    OpenMP that ``vllm-cpu`` installs into its virtualenv (``intel-openmp``: lib/)."""
    paths = []
    for name in which:
        if name == "tcmalloc":
            paths.append(str(ensure_tcmalloc()))
        elif name == "iomp5":
            iomp = python.parent.parent / "lib" / "libiomp5.so"  # not resolved: the venv's
            if not iomp.exists():
                raise RuntimeError(f"no {iomp}: is intel-openmp installed in vLLM's venv?")
            paths.append(str(iomp))
        else:
            raise SystemExit(f"unknown preload {name!r}: choose from {', '.join(PRELOADS)}")
    return paths


def physical_cores() -> list[int]:
    """One logical CPU per physical core this process may use, in order: vLLM's docs bind
    one OpenMP thread per physical core (a hyper-thread sibling would share its units)."""
    seen, cores = set(), []
    for cpu in sorted(os.sched_getaffinity(0)):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = tuple(
                (topology / f).read_text().strip() for f in ("physical_package_id", "core_id")
            )
        except OSError:
            key = (str(cpu),)
        if key not in seen:
            seen.add(key)
            cores.append(cpu)
    return cores


def vllm_env(
    python: Path,
    threads: int,
    kv_cache_gib: int,
    preload: Iterable[str] = PRELOADS,
    bind: bool = True,
) -> dict[str, str]:
    """What one vLLM engine process is given: its libraries preloaded, its KV cache size,
    and with ``bind`` its ``threads`` OpenMP threads bound one per physical core (logical
    CPUs where there are fewer; vLLM's default ``auto`` takes the NUMA node's cores less
    one for its engine core, whatever ``threads`` says). vLLM 0.32 binds only through its
    multiprocess executor (the model in a worker process it spawns): ``VLLM_EXECUTOR``
    tells ``vllm_worker.py`` which to use (``uni``: in the process, unbound, as before
    binding). Recorded in every run's JSON."""
    cores = physical_cores()
    if len(cores) < threads:
        cores = sorted(os.sched_getaffinity(0))
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores[:threads]),
        "VLLM_EXECUTOR": "mp",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "OMP_NUM_THREADS": str(threads),
    }
    if not bind:
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_EXECUTOR": "uni"}
    libs = vllm_preload(python, preload)
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    return env


def host_cpu() -> dict[str, Any]:
    """The CPU's model name and the instruction sets that decide the kernels of both
    engines (AMX and AVX-512 BF16 matrix products, AVX-512, AVX2)."""
    model, flags = None, set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and model is None:
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
    cpus = {"model": model, "logical_cpus": len(os.sched_getaffinity(0))}
    return cpus | {"physical_cores": len(physical_cores())} | {f: f in flags for f in CPU_FLAGS}


def provenance(repo: Path = REPO) -> dict[str, Any]:
    """The commit measured, whether the tree differed from it (uncommitted changes or new
    files: then the commit alone does not say what ran), and the host's CPU."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = git("status", "--porcelain").splitlines()
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(changed), "cpu": host_cpu()}
