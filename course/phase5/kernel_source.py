"""Phase 5, task inline_includes: a kernel file and the headers it includes, as the one source text tinygrad
compiles.

A hand-written kernel goes into tinygrad's graph as raw source (tinyvllm/kernels/launcher.py): the `#define`s of
its shapes, then the file. tinygrad compiles that text alone, from no folder, so every `#include "x.h"` of our own
headers must be pasted in first. The engine calls this as `tinyvllm.kernels.launcher._inline_includes` when it
reads a kernel's file (`_read_source`, once per file), for every kernel it launches. Chapter:
docs/phases/05-custom-kernels.md ("Build it"). Grade: make course P=5
"""

from __future__ import annotations

from pathlib import Path


def inline_includes(text: str, folder: Path, seen: set[str]) -> str:
    """`text` with each line `#include "name"` (quotes: our own headers; `#include <...>` lines stay as they are)
    replaced by the contents of folder / name, itself with its includes inlined the same way.

    A header is pasted once: the first `#include` of a name puts it in, later ones (in any file) become empty
    lines' worth of nothing (""), which is what `#pragma once` does; `seen` holds the names pasted so far, shared by
    the whole walk. The rest of an include line (a comment after it) goes with it. Hint: `re.sub` with a function,
    the pattern `^#include "([^"]+)"[^\\n]*$` and `flags=re.MULTILINE`.
    """
    raise NotImplementedError("course/phase5/kernel_source.py: inline_includes is yours to write")
