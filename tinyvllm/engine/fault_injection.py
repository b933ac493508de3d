"""Faults on command, to check that the server survives them (tests/api/test_reliability.py, bench_reliability.py).

`FaultInjector(engine)` replaces `engine.step`; each fault fires at the next step: `fail_next_step()`,
`fail_detokenization(text)`, `drain_kv_pool()` until `restore_kv_pool()`.
"""

from __future__ import annotations

import threading

from tinyvllm.core.block_manager import Block


class InjectedFault(RuntimeError):
    """Raised by an armed fault, so a log line can tell it from a real failure."""


class FaultInjector:
    def __init__(self, engine):
        self.engine = engine
        self._step = engine.step
        engine.step = self.step  # an attribute of this instance only: other engines are untouched
        self._lock = threading.Lock()  # the test's thread arms, the engine thread fires
        self._fail_step = False
        self._detokenize_markers: list[str] = []
        self._drain = False
        self._held: list[Block] = []  # blocks taken out of the pool
        self._checked: set[str] = set()  # request ids whose prompt was looked at for a marker
        self.fired = {"step": 0, "detokenization": 0, "kv_blocks_taken": 0}

    # ---- arming (any thread) ----

    def fail_next_step(self) -> None:
        with self._lock:
            self._fail_step = True

    def fail_detokenization(self, marker: str) -> None:
        if not marker:
            raise ValueError("fail_detokenization needs a non-empty marker to look for in prompts")
        with self._lock:
            self._detokenize_markers.append(marker)

    def drain_kv_pool(self) -> None:
        with self._lock:
            self._drain = True

    def restore_kv_pool(self) -> None:
        with self._lock:
            self._drain = False

    # ---- firing (the engine thread) ----

    def step(self):
        with self._lock:
            fail_step, self._fail_step = self._fail_step, False
            markers, drain = list(self._detokenize_markers), self._drain
        if markers:
            self._poison_detokenization(markers)
        if drain:
            self._take_free_blocks()
        elif self._held:
            self._give_blocks_back()
        if fail_step:
            self.fired["step"] += 1
            raise InjectedFault("injected fault: this engine step failed")
        return self._step()

    def _poison_detokenization(self, markers: list[str]) -> None:
        tokenizer = self.engine.tokenizer
        for request_id, state in list(self.engine.output_processor.request_states.items()):
            if request_id in self._checked:
                continue
            self._checked.add(request_id)
            prompt = state.prompt if state.prompt is not None else tokenizer.decode(state.prompt_token_ids)
            if any(marker in prompt for marker in markers):
                state.text.add = self._raise_on_detokenize

    def _raise_on_detokenize(self, token_id: int):
        self.fired["detokenization"] += 1
        raise InjectedFault(f"injected fault: detokenizing token {token_id} failed")

    def _take_free_blocks(self) -> None:
        """Every free block out of the free block queue, evicted from the prefix cache (as a hand-out would)."""
        bm = self.engine.scheduler.block_manager
        while bm.num_free_blocks:
            block = bm.free_block_queue.popleft()
            if block.block_hash is not None and bm.cached_blocks.get(block.block_hash) is block:
                del bm.cached_blocks[block.block_hash]
            block.block_hash = None
            self._held.append(block)
            self.fired["kv_blocks_taken"] += 1

    def _give_blocks_back(self) -> None:
        bm = self.engine.scheduler.block_manager
        for block in self._held:
            bm.free_block_queue.append(block)
        self._held.clear()
