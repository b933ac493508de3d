"""Phase 4, task buckets_up_to: the shapes the model runner captures a graph for.

A step's tokens from every running sequence are flattened into one row and padded up to the next bucket, so the
engine replays one of a few captured graphs instead of compiling one per batch size. The engine calls it as
`tinyvllm.worker.model_runner.buckets_up_to` when a `ModelRunner` is built (`self.token_buckets`; `bucket_for(n)`
picks the first bucket >= n). Chapter: docs/phases/04-batched-forward.md ("Build it"). Grade: make course P=4
"""

from __future__ import annotations


def buckets_up_to(limit: int) -> list[int]:
    """The token buckets for a step of at most `limit` tokens (max_num_batched_tokens): the powers of two below
    `limit`, then `limit` itself, in increasing order.

        buckets_up_to(512) -> [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        buckets_up_to(48)  -> [1, 2, 4, 8, 16, 32, 48]
        buckets_up_to(1)   -> [1]

    Padding wastes at most half a step's work, and there are only log2(limit) + 1 graphs to capture.
    """
    raise NotImplementedError("course/phase4/buckets.py: buckets_up_to is yours to write")
