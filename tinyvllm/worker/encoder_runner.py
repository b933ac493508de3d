"""The step's image side (vLLM v1's `_execute_mm_encoder`, `_gather_mm_embeddings`).

    batch      [ a5 | b0 <img> <img> <row> <img> | c9 ]
    mm_mask    [ 0  | 0  1     1     0     1     | 0  ]
    mm_embeds  [ .  | .  e0    e1    .     e2    | .  ]
"""

from __future__ import annotations

import numpy as np

from tinyvllm.core.encoder_cache import MultiModalFeature
from tinyvllm.core.sequence import Sequence
from tinyvllm.model.vision import ViTTower


class EncoderRunner:
    """Encoder outputs by image hash, encoded on a miss, dropped when the scheduler evicts them."""

    def __init__(self, tower: ViTTower):
        self.tower = tower
        self.encoder_cache: dict[str, np.ndarray] = {}  # mm_hash -> (num_embeds, D) float32
        self.num_encoder_runs = 0

    def free(self, mm_hashes: list[str]) -> None:
        for mm_hash in mm_hashes:
            self.encoder_cache.pop(mm_hash, None)

    def encoder_output(self, feature: MultiModalFeature) -> np.ndarray:
        if feature.mm_hash not in self.encoder_cache:
            self.encoder_cache[feature.mm_hash] = self.tower.encode(feature.data)
            self.num_encoder_runs += 1
        return self.encoder_cache[feature.mm_hash]

    def gather(self, chunks: list[tuple[Sequence, int, int, int]], embeds: np.ndarray, mask: np.ndarray) -> bool:
        """Fill embeds (N, D) and mask (N,) for each (seq, start, count, first flat row); any image rows?"""
        mask[...] = 0
        for seq, start, count, row in chunks:
            for feature in seq.mm_features:
                if not feature.overlaps(start, start + count):
                    continue
                lo, hi = (max(start, feature.offset) - feature.offset,
                          min(start + count, feature.offset + feature.length) - feature.offset)
                first = int(feature.is_embed[:lo].sum())  # rows of the earlier chunks
                at = np.flatnonzero(feature.is_embed[lo:hi]) + lo + feature.offset - start + row
                embeds[at] = self.encoder_output(feature)[first:first + len(at)]
                mask[at] = 1
        return bool(mask.any())
