"""Ray 2.60's KV-aware tokenizer (``ray.llm._internal.serve.routing_policies.kv_aware.vllm.
tokenizer``) imports ``load_chat_template`` from ``vllm.entrypoints.chat_utils``, where
vLLM 0.29 (Ray's pin) has it; vLLM 0.30 moved that module to ``vllm.renderers.chat_utils``,
and the vLLM CPU build these machines run is 0.32. Every other name that module imports is
where Ray expects it (checked). Installed into vLLM's virtualenv as a ``.pth`` line
(``bench.peers.engines.ensure_ray_llm_compat``), this finder answers the old name with the
new module, lazily: nothing is imported until someone asks for the old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD, NEW = "vllm.entrypoints.chat_utils", "vllm.renderers.chat_utils"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != OLD or importlib.util.find_spec(NEW) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return importlib.import_module(NEW)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        sys.modules[OLD] = module


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
