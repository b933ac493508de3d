"""Stop strings for a streamed output; the tail that could still become one is held back
(docs/phases/01-appendix-tokens-and-sampling.md)."""

from __future__ import annotations


class StopStringChecker:
    """Feed it each new piece of detokenized text; it says what may be shown and whether to stop."""

    def __init__(self, stop: list[str], include_in_output: bool = False):
        assert all(stop), "stop strings must be non-empty (SamplingParams validates this)"
        self.stop = list(stop)
        self.include_in_output = include_in_output
        self.stop_str: str | None = None  # vLLM's `stop_reason`
        self._tail = ""  # the longest tail that could start a stop string; its last `_num_held` chars are held
        self._num_held = 0

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def feed(self, new_text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was found)."""
        assert not self.stopped, "the output already stopped"
        text = self._tail + new_text
        emitted_upto = len(self._tail) - self._num_held  # text[:emitted_upto] is already out
        match = self._first_stop(text)
        if match is not None:
            end, self.stop_str = match
            self._tail, self._num_held = "", 0
            return text[emitted_upto:end], True
        tail_len = self._stop_prefix_len(text)
        self._tail = text[len(text) - tail_len:]
        self._num_held = 0 if self.include_in_output else tail_len
        return text[emitted_upto:len(text) - self._num_held], False

    def flush(self) -> str:
        """The held-back tail, at the end of a stream that did not stop."""
        held = self._tail[len(self._tail) - self._num_held:]
        self._tail, self._num_held = "", 0
        return held

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(where the output ends, which stop string) for the one that ends first in `text`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = text.find(s)
            if start != -1:
                candidate = (start + len(s), start, s)
                # if two end together, the one starting earlier, so no piece of it leaks
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        end, start, s = best
        return (end if self.include_in_output else start), s

    def _stop_prefix_len(self, text: str) -> int:
        """The longest tail of `text` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stop), default=0)
        for n in range(min(longest - 1, len(text)), 0, -1):
            tail = text[len(text) - n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
