"""The engine's C++ kernels: built once per machine with the system's g++, loaded as torch ops.

``make install`` builds them (``python -m replica.model.kernels``); a process that finds no build
for this source, compiler flags, torch version and CPU builds it then (about a minute, under a
file lock, so replicas starting together build once). Each op has a pure-torch reference in
``replica.model.attention`` that the tests compare it with; without a compiler, ``available()`` is
False and the engine refuses ``deterministic: true`` with a message saying why.

The build is ``-march=native`` (the kernels are as fast as this CPU allows and the library is
cached per CPU's flags) and ``-ffp-contract=off`` (the C++ decides every fused multiply-add;
see ``attention.cpp`` for why that matters). ``PREFIX_SERVE_KERNEL_FLAGS`` adds compiler flags
after these (a separate build, cached under its own name): ``-mno-avx512bf16`` builds, on a
CPU with AVX-512 BF16, the paths of one without it, which the tests run that way.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch
from torch.utils import cpp_extension

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "attention.cpp", HERE / "layers.cpp", HERE / "linear.cpp")
HEADERS = (HERE / "numerics.h",)
# where builds go: next to the source, or PREFIX_SERVE_KERNEL_DIR (an install that cannot write
# into its own package)
BUILD_DIR = Path(os.environ.get("PREFIX_SERVE_KERNEL_DIR") or Path(__file__).with_name("build"))
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fopenmp",
    "-std=c++20",
    "-shared",
    "-fPIC",
    "-DNDEBUG",
)


FLAGS_ENV = "PREFIX_SERVE_KERNEL_FLAGS"


def flags() -> tuple[str, ...]:
    """``FLAGS``, then those of ``PREFIX_SERVE_KERNEL_FLAGS`` (split as a shell splits)."""
    return (*FLAGS, *shlex.split(os.environ.get(FLAGS_ENV, "")))


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded here (no compiler, a compile error)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library_path() -> Path:
    """Where this source, these flags, this torch and this CPU's build lives."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    for part in (*flags(), torch.__version__, _cpu_flags()):
        digest.update(part.encode())
    return BUILD_DIR / f"prefix_serve_kernels-{digest.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (install g++: apt-get install g++)")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    command = [
        compiler,
        *flags(),
        *includes,
        *(str(s) for s in SOURCES),
        *libs,
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(tmp),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise KernelBuildError(f"compiling the kernels failed:\n{result.stderr[-4000:]}")
    tmp.rename(target)


def build() -> Path:
    """Build the library for this machine unless it exists; its path."""
    target = library_path()
    if target.exists():
        return target
    BUILD_DIR.mkdir(exist_ok=True)
    with open(BUILD_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same one
        if not target.exists():
            log.info("building the engine's kernels into %s", target)
            _compile(target)
    return target


@functools.cache
def load() -> None:
    """Build if needed and load the ops into ``torch.ops.prefix_serve`` (once per process)."""
    torch.ops.load_library(str(build()))


def available() -> bool:
    """Whether the kernels are loaded (building them if needed); False, logged, if not."""
    try:
        load()
    except (KernelBuildError, OSError) as exc:
        log.warning("engine kernels unavailable: %s", exc)
        return False
    return True
