"""Reasoning split (vLLM's `--reasoning-parser think`): `<think>...</think>` sent as `reasoning`, held
back only where a tag may still be forming. Taught in docs/phases/09-appendix-tools-and-reasoning.md.
"""

from __future__ import annotations

# --reasoning-parser: "think", and vLLM's names for models that write the same <think> tags
REASONING_PARSERS = ("none", "think", "qwen3", "deepseek_r1")


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` ("ab<thi" -> 4 for "<think>")."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkReasoningParser:
    """Split an output into (reasoning, content) pieces as it arrives."""

    START, END = "<think>", "</think>"

    def __init__(self, prompt_opened: bool = False):
        self.state = "reasoning" if prompt_opened else "start"
        self.has_reasoning = prompt_opened
        self.held = ""  # text not yet sent: it may still become a tag

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text` adds and that can already be sent."""
        self.held += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                head = self.held.lstrip()
                if head.startswith(self.START):
                    self.held, self.state, self.has_reasoning = head[len(self.START):], "reasoning", True
                    continue
                if self.START.startswith(head):
                    return reasoning, content
                self.state = "content"
            elif self.state == "reasoning":
                end = self.held.find(self.END)
                if end >= 0:
                    reasoning += self.held[:end]
                    self.held, self.state = self.held[end + len(self.END):], "content"
                    continue
                keep = partial_tag_length(self.held, self.END)
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, content
            else:
                content, self.held = content + self.held, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back is what it looked like."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)
