"""Which engine replica serves a request: the one most likely to hold the prompt's prefix (hashes of its first
blocks of characters, remembered per replica: vLLM production-stack's "prefix-aware routing"), then fewer requests
in flight, then the lower index; `policy="round_robin"` is the baseline. Taught in docs/phases/08-multi-device.md.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

POLICIES = ("prefix_affinity", "round_robin")


def prefix_hashes(prompt: str, block_chars: int) -> list[str]:
    """The hashes of the prompt's first 1, 2, ... whole blocks of `block_chars` characters (each chains the last)."""
    hashes, h = [], hashlib.sha256()
    for end in range(block_chars, len(prompt) + 1, block_chars):
        h.update(prompt[end - block_chars:end].encode())
        hashes.append(h.copy().hexdigest()[:16])
    return hashes


class PrefixAffinityRouter:
    def __init__(self, num_replicas: int, policy: str = "prefix_affinity", block_chars: int = 64,
                 max_prefixes: int = 100_000):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.num_replicas, self.policy, self.block_chars = num_replicas, policy, block_chars
        self.in_flight = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests sent to each, ever
        self.down: set[int] = set()
        self._seen: OrderedDict[str, set[int]] = OrderedDict()  # prefix hash -> replicas that computed it, LRU
        self._max_prefixes = max_prefixes
        self._next = 0  # round robin's turn

    def choose(self, prompt: str) -> int:
        """The replica for `prompt`; raises RuntimeError when every replica is down."""
        up = [i for i in range(self.num_replicas) if i not in self.down]
        if not up:
            raise RuntimeError("no engine replica is up")
        if self.policy == "round_robin":
            while self._next % self.num_replicas in self.down:
                self._next += 1
            choice = self._next % self.num_replicas
            self._next += 1
            return choice
        matched = {i: 0 for i in up}
        for depth, h in enumerate(prefix_hashes(prompt, self.block_chars), start=1):
            holders = self._seen.get(h, set()) & set(up)
            if not holders:
                break
            for i in holders:
                matched[i] = depth
        return min(up, key=lambda i: (-matched[i], self.in_flight[i], i))

    def started(self, replica: int, prompt: str) -> None:
        """The request with `prompt` went to `replica`: it will hold the prompt's prefixes from now on."""
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        for h in prefix_hashes(prompt, self.block_chars):
            self._seen.setdefault(h, set()).add(replica)
            self._seen.move_to_end(h)
        while len(self._seen) > self._max_prefixes:
            self._seen.popitem(last=False)

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def mark_down(self, replica: int) -> None:
        """The replica failed: route nothing more to it, and forget what it held."""
        self.down.add(replica)
        for holders in self._seen.values():
            holders.discard(replica)
