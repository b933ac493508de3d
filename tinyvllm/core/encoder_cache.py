"""Which images' encoder outputs the runner holds, by content hash (vLLM v1's `EncoderCacheManager`).

    prompt  t t <f> [img img <row> img img] <f> t      a MultiModalFeature: offset, is_embed, mm_hash
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class MultiModalFeature:
    """One image of a prompt (vLLM v1's `MultiModalFeatureSpec`)."""

    mm_hash: str
    offset: int  # its first <image> token's position
    is_embed: np.ndarray  # (length,) bool: the positions that take an encoder row
    data: np.ndarray  # pixel values (frames, 3, S, S)

    @property
    def length(self) -> int:
        return len(self.is_embed)

    @property
    def num_embeds(self) -> int:
        return int(self.is_embed.sum())

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.offset + self.length


class EncoderCacheManager:
    """Room for `cache_size` embeddings; an entry no request needs stays until its room is taken."""

    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.cached: dict[str, set[int | str]] = {}  # mm_hash -> the requests that need it
        self.sizes: dict[str, int] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()  # needed by none, oldest first
        self.freed: list[str] = []  # evicted since the last step
        self.num_queries = self.num_hits = 0

    @property
    def num_free_slots(self) -> int:
        return self.cache_size - sum(self.sizes.values())

    def check_and_update_cache(self, seq_id: int | str, feature: MultiModalFeature) -> bool:
        """Cached? Then `seq_id` holds it (a request's later chunks over the same image are not counted again)."""
        refs = self.cached.get(feature.mm_hash)
        if refs is not None and seq_id in refs:
            return True
        self.num_queries += 1
        if refs is None:
            return False
        self.num_hits += 1
        refs.add(seq_id)
        self.freeable.pop(feature.mm_hash, None)
        return True

    def can_allocate(self, feature: MultiModalFeature, budget: int, pending: int = 0,
                     keep: set[str] = frozenset()) -> bool:
        """Room for it within this step's `budget`, beside `pending` embeddings promised to the same request,
        evicting unneeded entries but those in `keep` if need be?"""
        freeable = sum(self.sizes[h] for h in self.freeable if h not in keep)
        return feature.num_embeds <= min(budget, self.num_free_slots + freeable - pending)

    def allocate(self, seq_id: int | str, feature: MultiModalFeature) -> None:
        while feature.num_embeds > self.num_free_slots:
            mm_hash, _ = self.freeable.popitem(last=False)
            del self.cached[mm_hash], self.sizes[mm_hash]
            self.freed.append(mm_hash)
        self.cached[feature.mm_hash] = {seq_id}
        self.sizes[feature.mm_hash] = feature.num_embeds

    def free_encoder_input(self, seq_id: int | str, feature: MultiModalFeature) -> None:

        refs = self.cached.get(feature.mm_hash)
        if refs is not None and seq_id in refs:
            refs.discard(seq_id)
            if not refs:
                self.freeable[feature.mm_hash] = None

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed
