"""Phase 5's graders: the GPU attention's launch choice (one launch, or flash-decoding's split and reduce) and the
kernel source's includes pasted in (course/phase5/). Plain Python: no GPU, no compiler."""

from __future__ import annotations

import pytest

from tinyvllm.attention import kernel_backend
from tinyvllm.attention.kernel_backend import GpuLaunch
from tinyvllm.kernels import launcher

# ---- gpu_attention_launches ----


def launches(*args, **kwargs) -> list[tuple[str, tuple[int, int, int]]]:
    return [(launch.entry, launch.grid) for launch in kernel_backend.gpu_attention_launches(*args, **kwargs)]


@pytest.mark.task("gpu_attention_launches")
def test_short_contexts_run_one_launch():
    got = launches(8, 8, 2, 512)
    assert got == [("paged_attention", (2, 8, 1))], (
        f"8 rows, 2 KV heads, 512 keys (one partition of 512): one block per (KV head, row), grid (2, 8, 1); got {got}")


@pytest.mark.task("gpu_attention_launches")
def test_few_rows_and_a_long_context_split():
    got = launches(4, 8, 2, 4096)
    expected = [("paged_attention_split", (16, 4, 1)), ("paged_attention_reduce", (8, 4, 1))]
    assert got == expected, (f"4 rows x 2 KV heads is 8 blocks: split 4096 keys into 8 partitions of 512, grid "
                             f"(2 * 8, 4, 1), then one reduce block per (query head, row), (8, 4, 1); got {got}")
    assert all(isinstance(launch, GpuLaunch) for launch in kernel_backend.gpu_attention_launches(4, 8, 2, 4096))


@pytest.mark.task("gpu_attention_launches")
def test_the_partition_count_rounds_up():
    got = launches(2, 4, 1, 100, partition_size=32)
    assert got[0] == ("paged_attention_split", (4, 2, 1)), f"100 keys in partitions of 32 make 4 parts; got {got}"
    got = launches(1, 4, 1, 513)
    assert got[0] == ("paged_attention_split", (2, 1, 1)), f"513 keys in partitions of 512 make 2 parts; got {got}"


@pytest.mark.task("gpu_attention_launches")
def test_a_big_grid_never_splits():
    got = launches(512, 16, 2, 8192)
    assert got == [("paged_attention", (2, 512, 1))], (
        f"512 rows x 2 KV heads = 1024 blocks > SPLIT_MAX_BLOCKS ({kernel_backend.SPLIT_MAX_BLOCKS}): the grid already "
        f"fills the GPU, one launch; got {got}")
    got = launches(256, 16, 2, 8192)
    assert len(got) == 2, f"256 rows x 2 KV heads = 512 blocks, not more than SPLIT_MAX_BLOCKS: split; got {got}"


# ---- inline_includes ----

@pytest.mark.task("inline_includes")
def test_includes_are_pasted_once(tmp_path):
    (tmp_path / "b.h").write_text("#define B 2\n")
    (tmp_path / "a.h").write_text('#include "b.h"\n#define A 1\n')
    text = '#include <stdint.h>\n#include "a.h"  // the a\n#include "b.h"\nint x;\n'
    got = launcher._inline_includes(text, tmp_path, set())
    expected = '#include <stdint.h>\n#define B 2\n\n#define A 1\n\n\nint x;\n'
    assert got == expected, (f"a.h pasted where it is included (with b.h inside it), b.h's second include gone, "
                             f"<stdint.h> kept:\nexpected {expected!r}\ngot      {got!r}")


@pytest.mark.task("inline_includes")
def test_seen_is_shared_by_the_caller(tmp_path):
    (tmp_path / "c.h").write_text("int c;\n")
    seen = {"c.h"}
    got = launcher._inline_includes('#include "c.h"\nint y;\n', tmp_path, seen)
    assert got == "\nint y;\n", f"c.h is in `seen` already: its include goes away; got {got!r}"
    seen = set()
    launcher._inline_includes('#include "c.h"\n', tmp_path, seen)
    assert seen == {"c.h"}, f"a header pasted is added to `seen`; seen is {seen}"


@pytest.mark.task("inline_includes")
def test_the_paged_attention_kernel_source_is_whole():
    path = launcher.kernel_path("paged_attention", "CPU")
    assert path is not None
    source = launcher._read_source.__wrapped__(path)  # what the engine compiles, read afresh
    assert '#include "' not in source, "the CPU paged-attention kernel still has an #include of our own headers"
    header = (path.parent / "exp_poly.h").read_text().strip().splitlines()[-1]
    assert source.count(header) == 1, f"exp_poly.h (its last line {header!r}) should be pasted exactly once"
