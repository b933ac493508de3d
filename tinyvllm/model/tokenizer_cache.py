"""The finished tokenizer kept on disk (a `disk_cache` record), keyed by the files it reads, its code, Python and
tiktoken (docs/phases/06-appendix-measurements.md)."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

from tinyvllm.disk_cache import cache_root, read_record, write_record
from tinyvllm.model import tokenizer as tokenizer_module
from tinyvllm.model.tokenizer import Tokenizer

ENABLED = os.getenv("TINYVLLM_TOKENIZER_CACHE", "1") != "0"
MAGIC = b"tinyvllm-tokenizer 1\n"
MAX_BYTES = 64 << 20  # of tokenizer files kept
# what load_tokenizer reads in an HF model directory
DIRECTORY_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja",
                   "generation_config.json")
# the modules that build a tokenizer: part of the key
CODE_FILES = ("tokenizer.py", "bpe.py", "sentencepiece_tokenizer.py", "sentencepiece_model.py", "gguf.py",
              "tokenizer_cache.py")


def cache_dir() -> Path:
    return cache_root() / "tokenizers"


@functools.cache
def code_identity() -> str:
    """sha256 of the tokenizer modules' source."""
    folder = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in CODE_FILES:
        path = folder / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()


def cache_key(path: Path) -> str:
    """Everything the tokenizer built from `path` depends on, as text."""
    import tiktoken  # its version reads the pickled tables back
    path = path.resolve()
    if path.is_file():  # a GGUF: size and mtime (hashing it costs more than a rebuild)
        st = path.stat()
        files = [(path.name, st.st_size, st.st_mtime_ns)]
    else:  # small files: their contents
        files = []
        for name in DIRECTORY_FILES:
            try:
                files.append((name, hashlib.sha256((path / name).read_bytes()).hexdigest()))
            except OSError:
                files.append((name, None))
    return repr((str(path), files, code_identity(), sys.version_info[:2], tiktoken.__version__))


def cache_path(key: str, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"{hashlib.sha256(key.encode()).hexdigest()}.tokenizer"


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """`tinyvllm.model.tokenizer.load_tokenizer(path)`, from the cache when it holds it."""
    path = Path(path)
    if not ENABLED or not path.exists():  # a missing path: load_tokenizer's error
        return tokenizer_module.load_tokenizer(path)
    key = cache_key(path)
    file = cache_path(key)
    try:
        tokenizer = read_record(file, MAGIC, key)
        if isinstance(tokenizer, Tokenizer):
            return tokenizer
    except Exception:  # missing, corrupt, stale: rebuild
        pass
    tokenizer = tokenizer_module.load_tokenizer(path)
    write_record(file, MAGIC, key, tokenizer, MAX_BYTES)
    return tokenizer
