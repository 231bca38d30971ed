"""A GGUF file's tokenizer, converted once and kept as a Hugging Face folder.

transformers builds a GGUF file's BPE tokenizer from its vocabulary and merges on every
load: 6-7 s for SmolLM2, paid by every replica, the ingress and every test process. The
converted tokenizer saved with ``save_pretrained`` loads in a third of a second. The
folder is keyed by the file (path, size, modification time) and transformers' version,
which is what the conversion depends on; it is written under a temporary name and renamed
into place, so two replicas converting at once never read half a folder. Where the cache
cannot be written (a read-only home), the tokenizer is converted as before.

``tests/test_tokenizer.py`` holds a cached tokenizer to a fresh conversion: the same ids,
texts, chat renderings and stop tokens.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

FORMAT = 1  # bump when what is saved changes
ENV = "PREFIX_SERVE_CACHE_DIR"


def cache_root() -> Path:
    """``$PREFIX_SERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefix-serve``, else
    ``~/.cache/prefix-serve``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefix-serve"


def tokenizer_folder(gguf_path: Path) -> Path | None:
    """A folder holding ``gguf_path``'s tokenizer, converted now if it is not there yet;
    None if the cache cannot be written (the caller converts the tokenizer itself)."""
    import transformers

    stat = gguf_path.stat()
    key = f"{FORMAT}|{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    key += f"|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = cache_root() / "tokenizers" / f"{gguf_path.stem}-{digest}"
    if (folder / "tokenizer.json").is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    except OSError:
        return None
    try:
        from transformers import AutoTokenizer

        converted = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        converted.save_pretrained(str(tmp))
        os.rename(tmp, folder)  # atomic; fails if another process got there first
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder if (folder / "tokenizer.json").is_file() else None
