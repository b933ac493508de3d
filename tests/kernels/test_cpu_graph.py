"""GraphedJit / CPUGraph (tinyvllm/kernels/cpu_graph.py), the program cache and the cache zeros.

The CPU graph must give exactly what tinygrad's own replay gives, with new input buffers and new
symbolic values on every call, and must step aside (tinygrad's replay) where it cannot apply.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, UOp, dtypes
from tinygrad.engine.jit import JitError

from tinyvllm.device_memory import zeros
from tinyvllm.kernels import cpu_graph, program_cache, scratch
from tinyvllm.kernels.cpu_graph import CPUGraph, GraphedJit
from tinyvllm.kernels.linear import linear
from tinyvllm.tinygrad_ext.jit import arena_buffers

POS = UOp.variable("test_pos", 0, 31)


def many_kernels(x: Tensor, w: Tensor, pos) -> Tensor:
    """~40 kernels: elementwise chains, a reduction, a matmul (the C kernel on CPU), a symbolic slice."""
    y = x
    for i in range(30):
        y = (y * 1.001 + i * 1e-3).contiguous()
    h = linear(y, w)  # (4, 16)
    return (h[:, : pos + 1].sum(axis=1) + y.max(axis=1)).realize()


def reference(x: np.ndarray, w: np.ndarray, pos: int) -> np.ndarray:
    y = x.astype(np.float64)
    for i in range(30):
        y = y * 1.001 + i * 1e-3
    h = y @ w.astype(np.float64).T
    return h[:, : pos + 1].sum(axis=1) + y.max(axis=1)


@pytest.fixture()
def inputs():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(6)]
    w = rng.standard_normal((16, 8)).astype(np.float32)
    return xs, w


def test_graphed_jit_matches_numpy_and_tinyjit_with_new_buffers_and_values(inputs):
    xs, w_np = inputs
    w = Tensor(w_np).realize()
    plain, graphed = TinyJit(many_kernels), GraphedJit(many_kernels)
    for step, x_np in enumerate(xs):
        pos = (step * 7) % 16
        # a fresh input buffer every call: the table's input addresses must be patched
        got = graphed(Tensor(x_np).realize(), w, POS.bind(pos)).numpy()
        want = plain(Tensor(x_np).realize(), w, POS.bind(pos)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got, reference(x_np, w_np, pos), rtol=1e-4, atol=1e-4)
    assert isinstance(graphed.graph, CPUGraph)
    assert graphed.graph.num_calls >= 30
    assert graphed.graph.var_names == ["test_pos"]


def test_captures_on_first_call(inputs):
    xs, w_np = inputs
    graphed = GraphedJit(many_kernels)
    out = graphed(Tensor(xs[0]).realize(), Tensor(w_np).realize(), POS.bind(3)).numpy()
    assert graphed.captured is not None  # a plain TinyJit would only have run eagerly
    np.testing.assert_allclose(out, reference(xs[0], w_np, 3), rtol=1e-4, atol=1e-4)
    eager_first = GraphedJit(many_kernels, capture_first=False)
    eager_first(Tensor(xs[0]).realize(), Tensor(w_np).realize(), POS.bind(3))
    assert eager_first.captured is None


def test_a_graph_that_writes_its_input_matches_tinyjit():
    def accumulate(acc: Tensor, x: Tensor) -> Tensor:
        acc.assign(acc + x).realize()
        return (acc * 2).realize()

    results = []
    for jit in (TinyJit(accumulate), GraphedJit(accumulate)):
        acc = Tensor.zeros(4).contiguous().realize()
        outs = [jit(acc, Tensor.full((4,), float(i)).contiguous().realize()).numpy()[0] for i in range(1, 6)]
        results.append((outs, acc.numpy()[0]))
    assert isinstance(jit.graph, CPUGraph)
    assert results[0] == results[1]
    assert results[1][1] == 15.0  # 1+2+3+4+5, accumulated in the caller's buffer


def test_output_fed_back_as_input_keeps_tinygrads_replay():
    def step(x: Tensor) -> Tensor:
        return (x * 2 + 1).realize()

    jit = GraphedJit(step)
    x = Tensor([1.0, 2.0]).realize()
    for _ in range(4):
        x = jit(x)  # from the second call on, x is the graph's own output buffer
    assert jit.graph is False  # tinygrad copies such an input before the graph overwrites it; the table cannot
    np.testing.assert_allclose(x.numpy(), [31.0, 47.0])


def test_disabled_gives_same_answers(inputs, monkeypatch):
    xs, w_np = inputs
    w = Tensor(w_np).realize()
    monkeypatch.setattr(cpu_graph, "ENABLED", False)
    jit = GraphedJit(many_kernels)
    outs = [jit(Tensor(x).realize(), w, POS.bind(5)).numpy() for x in xs[:4]]
    assert jit.graph is None
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out, reference(x, w_np, 5), rtol=1e-4, atol=1e-4)


def test_shape_change_is_an_error(inputs):
    xs, w_np = inputs
    w = Tensor(w_np).realize()
    jit = GraphedJit(many_kernels)
    for x in xs[:3]:
        jit(Tensor(x).realize(), w, POS.bind(1))
    with pytest.raises(JitError, match="args mismatch"):
        jit(Tensor(np.zeros((5, 8), np.float32)).realize(), w, POS.bind(1))


# ---- one scratch for every graph (kernels/scratch.py) ----

def two_intermediates(x: Tensor) -> Tensor:
    """Two intermediate buffers of x's size each (planned into the graph's arena), one small output."""
    y = (x * 2 + 1).contiguous()
    z = (y.exp2() - x).contiguous()
    return (z.sum(axis=1) + y.max(axis=1)).realize()


def two_intermediates_reference(x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float64) * 2 + 1
    return (np.exp2(y) - x).sum(axis=1) + y.max(axis=1)


def resident_bytes() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return sum(int(status[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


@pytest.mark.skipif(scratch.shared_scratch() is None, reason="no shared scratch on this system")
def test_graphs_of_every_shape_run_in_one_scratch_and_hold_the_largest_arena_only():
    """A graph per shape bucket, as the runner has: each one's intermediates move into the shared scratch (its table
    points at the scratch's base), their answers stay right whichever ran last, and the process holds about the
    largest arena, not their sum (before: every bucket kept its own)."""
    rng = np.random.default_rng(0)
    sizes = (1024, 1536, 2048)  # rows of 4096 floats: arenas of 32, 48 and 64 MiB, 144 MiB in all
    jits = {n: GraphedJit(two_intermediates) for n in sizes}
    inputs = {n: Tensor(rng.standard_normal((n, 4096), dtype=np.float32) * 0.1).realize() for n in sizes}
    wanted = {n: two_intermediates_reference(inputs[n].numpy()) for n in sizes}
    before = resident_bytes()
    for _ in range(3):  # a capture, then replays, interleaved
        for n in sizes:
            np.testing.assert_allclose(jits[n](inputs[n]).numpy(), wanted[n], rtol=1e-4)
    shared = scratch.shared_scratch()
    arenas = {n: sum(b.nbytes for b in arena_buffers(jits[n])) for n in sizes}
    assert arenas[2048] >= 2 * 2048 * 4096 * 4 > arenas[1536] > arenas[1024]
    for n in sizes:
        graph = jits[n].graph
        assert isinstance(graph, CPUGraph) and graph.scratch is shared
        in_scratch = [a for a in graph.table.tolist() if shared.base <= a < shared.base + shared.size]
        assert min(in_scratch) == shared.base
    grown = resident_bytes() - before
    assert grown < arenas[2048] + (16 << 20), (grown >> 20, {n: a >> 20 for n, a in arenas.items()})


@pytest.mark.skipif(scratch.shared_scratch() is None, reason="no shared scratch on this system")
def test_graphs_replayed_from_two_threads_take_turns_in_the_scratch():
    """Two engines' graphs in one process (a server's thread and an offline LLM) use the same scratch: the lock lets
    one run at a time, so neither reads the other's intermediates."""
    import threading

    rng = np.random.default_rng(1)
    work = []
    for n in (256, 512):
        x = Tensor(rng.standard_normal((n, 4096), dtype=np.float32) * 0.1).realize()
        jit = GraphedJit(two_intermediates)
        jit(x)
        work.append((jit, x, two_intermediates_reference(x.numpy())))
    errors = []

    def replay(jit, x, want):
        for _ in range(40):
            got = jit(x).numpy()
            if not np.allclose(got, want, rtol=1e-4):
                errors.append(np.abs(got - want).max())

    threads = [threading.Thread(target=replay, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(w[0].graph.scratch is scratch.shared_scratch() for w in work)


def test_program_cache_writes_through_and_reads_back(tmp_path):
    first = program_cache.DiskProgramCache(tmp_path)
    key = (b"\x01\x02", int, "target", 0)
    first[key] = {"program": 1}
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    second = program_cache.DiskProgramCache(tmp_path)  # a new process: nothing in memory
    assert dict.__len__(second) == 0
    assert key in second and second[key] == {"program": 1} and second.get(key) == {"program": 1}
    assert second.hits == 1
    assert (b"\x03", int, "target", 0) not in second and second.get((b"\x03",)) is None
    with pytest.raises(KeyError):
        second[(b"\x03",)]


def test_program_cache_treats_a_corrupt_file_as_a_miss(tmp_path):
    cache = program_cache.DiskProgramCache(tmp_path)
    key = (b"\x07", str)
    (tmp_path / f"{program_cache.key_digest(key)}.pkl").write_bytes(b"not a pickle")
    assert key not in cache
    cache[key] = "lowered again"
    assert program_cache.DiskProgramCache(tmp_path)[key] == "lowered again"


def test_program_cache_is_what_tinygrad_uses():
    import tinygrad.codegen
    import tinygrad.engine.realize

    installed = program_cache.install()  # (or the one this process's first model load installed)
    assert installed is not None
    assert tinygrad.codegen.to_program_cache is installed is tinygrad.engine.realize.to_program_cache
    assert program_cache.install() is installed  # once per process


def test_cache_zeros_stay_zero_after_buffers_are_reused():
    shape = (64, 16, 3, 64)
    for _ in range(3):
        t = zeros(shape, dtypes.float32, "CPU")
        assert t.uop.is_realized and t.abs().max().item() == 0.0
        t.assign(t + 7.0).realize()  # dirty it; the next round must not see these values
        del t
