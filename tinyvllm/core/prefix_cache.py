"""Automatic prefix caching: a full block of K/V is named by a SHA-256 hash chained through its parents (vLLM v1's
`kv_cache_utils.py`), so a prompt finds the blocks of a prefix computed before. Taught in
docs/phases/07a-prefix-caching.md.

    block 0 [t0 .. t15]    h0 = H(NONE_HASH, (t0 .. t15), extra)
    block 1 [t16 .. t31]   h1 = H(h0, (t16 .. t31), extra)          same h1 <=> same 32 tokens from the start
    block 2 [t32 .. t37]   not full: never cached (its K/V will still change)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

NONE_HASH = hashlib.sha256(b"tinyvllm prefix cache").digest()  # the parent of every sequence's first block


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """The hash of one full block: chained through its parent, so it names the whole prefix up to it."""
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[bytes], extra_keys: tuple = (),
                 mm_features: Sequence = ()) -> list[bytes]:
    """Extend `known` (the hashes computed before) to every full block of `token_ids`; returns it. A block with
    image tokens also hashes its images' `mm_hash`."""
    for i in range(len(known), len(token_ids) // block_size):
        parent = known[i - 1] if i else NONE_HASH
        start, end = i * block_size, (i + 1) * block_size
        images = tuple(f.mm_hash for f in mm_features if f.overlaps(start, end))
        known.append(hash_block_tokens(parent, token_ids[start:end], extra_keys + images))
    return known
