"""Phase 7a, task block_hashes: the names of a sequence's full blocks, each chained through the one before.

The engine calls it as `tinyvllm.core.prefix_cache.block_hashes` from `Sequence.block_hashes` (the block manager
looks a new prompt's blocks up in the cache at admission, and offers each block it fills). Chapter:
docs/phases/07a-prefix-caching.md ("Build it"). Grade: make course P=7
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyvllm.core.prefix_cache import NONE_HASH, hash_block_tokens


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[bytes], extra_keys: tuple = ()) -> list[bytes]:
    """Extend `known` to the hash of every full block of `token_ids`, and return it (the same list).

    Block i holds token_ids[i * block_size:(i + 1) * block_size]; only full blocks are hashed (a partial last block
    will still change). Its hash is hash_block_tokens(parent, its tokens, extra_keys), the parent being block i-1's
    hash, or NONE_HASH for block 0: so equal hashes mean equal tokens from the very start, not just in the block.
    `known` holds the hashes computed at an earlier step (a running sequence grows by a token a step): start after
    them, never hash a block twice.
    """
    raise NotImplementedError("course/phase7/prefix_cache.py: block_hashes is yours to write")
