"""The C matmul kernel (kernels/cpu/matmul.c) against numpy, under TinyJit and inside `function(precompile=True)`."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes, function

from tinyvllm.kernels import cpu_threads, launcher
from tinyvllm.kernels import linear as linear_module
from tinyvllm.kernels.linear import linear, uses_kernel

pytestmark = pytest.mark.skipif(not launcher.has_kernel("matmul", Device.DEFAULT), reason="no C kernel on this device")

RTOL, ATOL = 1e-5, 1e-4


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


def random(*shape: int, seed: int) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)).realize()


# (N, K): odd sizes that are not multiples of the 8-float vectors or the 3- and 4-row tiles, and the model's qkv
@pytest.mark.parametrize("N,K", [(7, 5), (37, 37), (13, 131), (100, 64), (960, 576)])
@pytest.mark.parametrize("M", [1, 3, 8, 32, 64])
def test_matches_numpy(M: int, N: int, K: int):
    x, w = random(M, K, seed=M), random(N, K, seed=N + K)
    assert uses_kernel(x, w)
    np.testing.assert_allclose(linear(x, w).numpy(), reference(x.numpy(), w.numpy()), rtol=RTOL, atol=ATOL)


def test_leading_dims_and_views():
    # (B,T,K) in, (B,T,N) out; x a non-contiguous view (a transpose) is made contiguous for the kernel
    x, w = random(5, 2, 24, seed=1).permute(1, 0, 2), random(19, 24, seed=2)
    out = linear(x, w)
    assert out.shape == (2, 5, 19)
    np.testing.assert_allclose(out.numpy(), reference(x.numpy().reshape(10, 24), w.numpy()).reshape(2, 5, 19),
                               rtol=RTOL, atol=ATOL)


def test_lm_head_sized_weight():
    x, w = random(2, 576, seed=3), random(49152, 576, seed=4)
    np.testing.assert_allclose(linear(x, w).numpy(), reference(x.numpy(), w.numpy()), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("K", [200, 203])  # 203: a K % 8 leftover after the 8-lane sums
def test_a_rows_result_does_not_depend_on_its_batch_or_the_tile(K: int):
    # batch invariance: every output is the same 8-lane sum over K then the same horizontal sum, whatever M and
    # whatever tile computed it (AVX-512's 6 x 4, AVX2's 4 x 3, the edge tiles, M = 1's 1 x 8, and on an AVX-512F
    # CPU the packed 6 x 8 tile, two rows of w per 512-bit register, here from 2 rows on instead of TV_PACK_MIN_M)
    N = 37  # 32 rows of w in packed tiles, 5 left over
    x, w = np.random.default_rng(8).standard_normal((37, K), dtype=np.float32), random(N, K, seed=9)
    alone = linear(Tensor(x[:1]).realize(), w).numpy()[0]
    for M in (2, 5, 8, 11, 37):
        rows = {}
        for tile in ((4, 3), (6, 4), None):  # the two defaults (whichever this CPU has), then the kernel's choice
            chosen = {"TV_TILE_MR": tile[0], "TV_TILE_NR": tile[1]} if tile else {"TV_PACK_MIN_M": 2}
            defines = {"TV_M": M, "TV_N": N, "TV_K": K, **chosen}
            out = Tensor.empty(M, N, dtype=dtypes.float32)
            (out,) = launcher.launch("matmul", outs=[out], ins=[Tensor(x[:M]).realize(), w], defines=defines)
            rows[tile] = out.numpy()
            np.testing.assert_array_equal(rows[tile][0], alone, err_msg=f"M={M}, tile {tile}")
        np.testing.assert_array_equal(rows[(4, 3)], rows[(6, 4)], err_msg=f"M={M}: the tiles differ")
        np.testing.assert_array_equal(rows[(6, 4)], rows[None], err_msg=f"M={M}: the kernel's own tile differs")


def test_same_bits_with_and_without_threads():
    x, w = random(32, 576, seed=5), random(1536, 576, seed=6)
    with cpu_threads.threads_enabled(True):
        a = linear(x, w).numpy()
    with cpu_threads.threads_enabled(False):
        b = linear(x, w).numpy()
    np.testing.assert_array_equal(a, b)


def test_tinyjit_replays_with_new_inputs():
    w = random(100, 64, seed=7)
    jit = TinyJit(lambda x: linear(x, w).realize())
    for i in range(4):  # run, capture, replay, replay
        x = random(3, 64, seed=10 + i)
        np.testing.assert_allclose(jit(x).numpy(), reference(x.numpy(), w.numpy()), rtol=RTOL, atol=ATOL)
    names = [c.src[0].arg.name for c in jit.captured.linear.src if c.src[0].op.name == "PROGRAM"]
    assert "matmul_3_100_64" in names, names


def test_inside_precompiled_function_under_jit():
    # the model wraps each decoder layer in function(precompile=True) and runs it under TinyJit
    @function(precompile=True)
    def layer(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        return linear(linear(x, w1).relu(), w2) + x

    w1, w2 = random(48, 32, seed=8), random(32, 48, seed=9)
    jit = TinyJit(lambda x: (layer(x, w1, w2) * 1).realize())
    for i in range(4):
        x = random(1, 4, 32, seed=20 + i)
        xn = x.numpy().reshape(4, 32)
        ref = np.maximum(reference(xn, w1.numpy()), 0) @ w2.numpy().T + xn
        np.testing.assert_allclose(jit(x).numpy().reshape(4, 32), ref, rtol=1e-4, atol=ATOL)


def test_portable_path_when_not_supported(monkeypatch: pytest.MonkeyPatch):
    x, w = random(3, 16, seed=11), random(5, 16, seed=12)
    assert not uses_kernel(x.half(), w.half())
    v = UOp.variable("tokens", 1, 8).bind(3)
    assert not uses_kernel(Tensor.empty(8, 16)[:v], w)  # a symbolic number of rows
    monkeypatch.setattr(linear_module, "PORTABLE", True)
    assert not uses_kernel(x, w)
    np.testing.assert_allclose(linear(x, w).numpy(), reference(x.numpy(), w.numpy()), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name,entry,defines", [("matmul", "matmul", {"TV_M": 3, "TV_N": 5, "TV_K": 7}),
                                                ("threadpool_worker", "threadpool_worker", {})])
def test_entry_function_is_first_in_object(name: str, entry: str, defines: dict):
    source = launcher.kernel_source(name, "CPU", {**defines, "TV_POOL_ADDR": hex(cpu_threads.pool_address())})
    launcher.check_entry_is_first(Device["CPU"].compiler.compile_cached(source), entry)


def test_pool_threads_started():
    if not cpu_threads._supported():
        pytest.skip("single-threaded here")
    assert cpu_threads.pool_address() != 0
    assert cpu_threads.num_threads() == cpu_threads.NUM_THREADS
    assert all(t.is_alive() for t in cpu_threads._state.threads)
    # the CPU kernels are compiled for the pool's size: a matrix-vector product's rows cut into one share per thread
    assert cpu_threads.pool_size() == cpu_threads.NUM_THREADS
    _, source = launcher.program_source("qmatmul_k", "CPU", {"TV_M": 1, "TV_N": 64, "TV_K": 256, "TV_QTYPE": 12})
    assert f"#define TV_THREADS {cpu_threads.NUM_THREADS}\n" in source
    with cpu_threads.threads_enabled(False):  # switched off for a while: still the same program
        assert cpu_threads.num_threads() == 1 and cpu_threads.pool_size() == cpu_threads.NUM_THREADS


def test_float16_uses_portable_path():
    x, w = random(2, 8, seed=13).cast(dtypes.float16), random(3, 8, seed=14).cast(dtypes.float16)
    np.testing.assert_allclose(linear(x, w).numpy(), reference(x.numpy(), w.numpy()), rtol=1e-2, atol=1e-2)


POOL_STRESS_C = r"""
/* Two threads launch jobs of 1-40 chunks on one pool with 3 helpers, with idle gaps that make the helpers park;
 * every chunk of every job must run exactly once, and nothing may hang. */
#include <pthread.h>
#include <semaphore.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#define TV_POOL_ADDR 0x200000000000ull
#include "threadpool.h"
#define NUM_HELPERS 3
static struct tv_pool* pool = (struct tv_pool*)TV_POOL_ADDR;
static int errors;
struct job { int* hits; };
static void chunk(const void* ctx, int c) {
  __atomic_fetch_add(&((const struct job*)ctx)->hits[c], 1, __ATOMIC_RELAXED);
  for (volatile int i = 0; i < (c % 7) * 50; i++) {}
}
static void* helper(void* i) { tv_pool_worker_loop(pool, (unsigned)(long)i); return 0; }
static void* launcher(void* arg) {
  unsigned seed = (unsigned)(long)arg;
  for (int it = 0; it < 60000; it++) {
    int n = 1 + rand_r(&seed) % 40, hits[40] = {0};
    struct job j = {hits};
    tv_parallel_for(chunk, &j, n);
    for (int c = 0; c < n; c++) if (hits[c] != 1) __atomic_fetch_add(&errors, 1, __ATOMIC_RELAXED);
    if (it % 500 == 0) for (volatile int i = 0; i < 300000; i++) {}
  }
  return 0;
}
int main(void) {
  if (mmap(pool, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != pool) return 2;
  pool->sem_wait = (int (*)(void*))sem_wait;
  pool->sem_post = (int (*)(void*))sem_post;
  pool->sched_yield = sched_yield;
  for (int i = 0; i < NUM_HELPERS; i++) sem_init((sem_t*)&pool->sems[i], 0, 0);
  pool->num_workers = NUM_HELPERS;
  pool->enabled = 1;
  pthread_t h[NUM_HELPERS], l[2];
  for (long i = 0; i < NUM_HELPERS; i++) pthread_create(&h[i], 0, helper, (void*)i);
  for (long i = 0; i < 2; i++) pthread_create(&l[i], 0, launcher, (void*)(i + 1));
  for (int i = 0; i < 2; i++) pthread_join(l[i], 0);
  printf("errors %d jobs %llu\n", errors, pool->ticket >> 32);
  printf("layout %zu %zu %zu %zu\n", sizeof(struct tv_pool), offsetof(struct tv_pool, ticket),
         offsetof(struct tv_pool, sleeping), offsetof(struct tv_pool, sems));
  return errors != 0;
}
"""


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("clang") is None, reason="needs Linux and clang")
def test_thread_pool_protocol_under_contention(tmp_path: Path):
    # the pool's C protocol alone (threadpool.h, unmodified), hammered by real threads: a race here is a wrong or
    # missing chunk, or a hang, that a few matmuls in Python would almost never show
    # (an earlier version of the protocol, with the chunk count outside the ticket, failed ~1 run in 6 here)
    source, binary = tmp_path / "stress.c", tmp_path / "stress"
    source.write_text(POOL_STRESS_C)
    subprocess.run(["clang", "-O2", "-pthread", f"-I{launcher.KERNELS_DIR / 'cpu'}", str(source), "-o", str(binary)],
                   check=True)
    result = subprocess.run([str(binary)], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # and Python's mirror of the control block has the C layout
    P = cpu_threads.TvPool
    layout = [ctypes.sizeof(P), P.ticket.offset, P.sleeping.offset, P.sems.offset]
    assert result.stdout.split("layout ")[1].split() == [str(n) for n in layout], result.stdout


def test_helpers_stop_at_exit():
    # the helpers run code that lives in a compiled program's memory, unmapped when the interpreter frees it at
    # exit: they must have returned by then (a helper still spinning there crashed the process)
    if not cpu_threads._supported():
        pytest.skip("single-threaded here")
    script = (
        "from tinygrad import Tensor\n"
        "from tinyvllm.kernels import cpu_threads\n"
        "from tinyvllm.kernels.linear import linear\n"
        "x, w = Tensor.ones(1, 64).contiguous().realize(), Tensor.ones(4000, 64).contiguous().realize()\n"
        "assert linear(x, w).numpy().max() == 64\n"
        "threads = list(cpu_threads._state.threads)\n"
        "assert threads and all(t.is_alive() for t in threads)\n"
        "cpu_threads._stop()  # what atexit runs\n"
        "assert not any(t.is_alive() for t in threads)\n"
        "assert linear(x, w).numpy().max() == 64  # still works, on the calling thread\n"
    )
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120,
                            cwd=launcher.KERNELS_DIR.parent)
    assert result.returncode == 0, result.stdout + result.stderr
