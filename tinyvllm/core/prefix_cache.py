"""Automatic prefix caching: a full block of K/V is found again by the tokens that made it (Phase 7).

Chat clients resend the whole conversation every turn, and many requests share a system prompt. The K/V
of a block depends only on its tokens and on every token before it, so a block can be named by a hash
chained through its parents (vLLM v1's design, `vllm/v1/core/kv_cache_utils.py`):

    block 0 [t0 .. t15]    h0 = H(NONE_HASH, (t0 .. t15), extra)
    block 1 [t16 .. t31]   h1 = H(h0, (t16 .. t31), extra)          same h1 <=> same 32 tokens from the start
    block 2 [t32 .. t37]   not full: never cached (its K/V will still change)

`extra` holds anything else the K/V depend on (a LoRA or multimodal id: the hook is kept, nothing fills it
yet). A table maps hashes to the blocks that hold them. At admission the longest run of cached blocks at
the start of a prompt is taken as already computed, and only the rest is computed; a block whose last
user frees it keeps its hash and waits in the free queue, evicted least recently used first.

Why a hash can be trusted: H is SHA-256 over the parent hash, the token ids and the extra keys. Two
different prefixes giving the same 256-bit hash is a collision of SHA-256; with n cached blocks the chance
of any is at most n^2 / 2^257, about 10^-65 for a million blocks. (vLLM offers Python's 64-bit `hash` as a
faster option; 64 bits leave ~2.7e-8 at a million blocks, so it is not used here.)
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


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[bytes], extra_keys: tuple = ()) -> list[bytes]:
    """Extend `known` (the hashes of the first full blocks, computed before) to every full block of
    `token_ids`; returns it. Each hash is computed once per sequence, as its blocks fill."""
    for i in range(len(known), len(token_ids) // block_size):
        parent = known[i - 1] if i else NONE_HASH
        known.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys))
    return known
