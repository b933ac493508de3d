"""How fast can this machine read memory? The ceiling of single-stream decode, measured in the run.

On a GPU the memory that matters is the GPU's: `measure_bandwidth_on(device)` measures the device the run uses
(a tinygrad reduction over 1 GiB there), the CPU's cores otherwise.

    python benchmarks/bandwidth.py          # prints the read bandwidth with 1 thread and with every core

Decoding one sequence reads every weight once per token, so the best a decode step can do is
bytes of weights / read bandwidth. The bandwidth has to be the machine's real read rate:

  - a numpy copy counts a write per read and is single-threaded (here ~26-31 GB/s "read + write");
  - numpy's reductions (`a.sum()`) are pairwise float sums, far from a full-speed read;
  - so a small C function does it: each thread sums its slice of the buffer with 256-bit (AVX2) loads into
    8 independent accumulators (8 x 32 B in flight, so the add latency never stalls the loads), and the
    buffer is several times larger than the last-level cache, so every byte comes from DRAM.

Compiled with clang (tinygrad's CPU device needs it anyway) and called through ctypes.

Prefill is bounded by arithmetic instead: `measure_int8_dot_rate()` times the integer inner step of the quantized
kernels (kernels/cpu/qmatmul.c, qmatmul_k.c) on registers alone, no memory, 8 independent chains per thread:

  - "k_quants": 32 u8 x s8 products summed in pairs (_mm256_maddubs_epi16), then times 16-bit sub-block scales
    into int32 (_mm256_dpwssd_epi32 with AVX-512 VNNI, madd + add without): the K-quants' step;
  - "vnni": 32 u8 x s8 products summed in fours into int32 (_mm256_dpbusd_epi32): Q8_0's and Q4's step.

A kernel's GFLOP/s (2 per product) against this is how much of the cores' multipliers it keeps busy.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

C_SOURCE = r"""
#include <pthread.h>
#include <stddef.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct { const float *p; size_t n; float sum; } slice_t;

static void *read_slice(void *arg) {
  slice_t *s = (slice_t *)arg;
  size_t i = 0;
  float sum = 0.0f;
#if defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (; i + 64 <= s->n; i += 64) {  /* 64 floats = 256 B = 4 cache lines per iteration */
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(s->p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(s->p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(s->p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(s->p + i + 24));
    a4 = _mm256_add_ps(a4, _mm256_loadu_ps(s->p + i + 32));
    a5 = _mm256_add_ps(a5, _mm256_loadu_ps(s->p + i + 40));
    a6 = _mm256_add_ps(a6, _mm256_loadu_ps(s->p + i + 48));
    a7 = _mm256_add_ps(a7, _mm256_loadu_ps(s->p + i + 56));
  }
  __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  float lanes[8];
  _mm256_storeu_ps(lanes, a);
  for (int k = 0; k < 8; k++) sum += lanes[k];
#endif
  for (; i < s->n; i++) sum += s->p[i];  /* the tail, or everything without AVX2 */
  s->sum = sum;
  return NULL;
}

/* the sum of p[0..n), read by `threads` threads, each its own contiguous slice */
float read_buffer(const float *p, size_t n, int threads) {
  pthread_t tid[64];
  slice_t slices[64];
  if (threads > 64) threads = 64;
  size_t chunk = (n / threads) & ~(size_t)63;
  for (int t = 0; t < threads; t++) {
    slices[t].p = p + t * chunk;
    slices[t].n = t == threads - 1 ? n - t * chunk : chunk;
    pthread_create(&tid[t], NULL, read_slice, &slices[t]);
  }
  float sum = 0.0f;
  for (int t = 0; t < threads; t++) {
    pthread_join(tid[t], NULL);
    sum += slices[t].sum;
  }
  return sum;
}

#if defined(__AVX2__)
typedef struct { long n; int kind; int out; } dot_job_t;
#define OPAQUE(v) __asm__ volatile("" : "+x"(v))  /* the compiler may not hoist the products out of the loop */

static void *dot_chains(void *arg) {
  dot_job_t *j = (dot_job_t *)arg;
  __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(4), a2 = _mm256_set1_epi8(5), a3 = _mm256_set1_epi8(6);
  const __m256i s = _mm256_set1_epi16(2);
  __m256i c[8] = {_mm256_setzero_si256()};
  for (long i = 0; i < j->n; i++) {
    OPAQUE(a0); OPAQUE(a1); OPAQUE(a2); OPAQUE(a3);
    __m256i u[8] = {a0, a1, a2, a3, a0, a1, a2, a3}, v[8] = {a1, a2, a3, a0, a2, a3, a0, a1};
    for (int k = 0; k < 8; k++) {
      if (j->kind == 0) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        c[k] = _mm256_dpwssd_epi32(c[k], _mm256_maddubs_epi16(u[k], v[k]), s);
#else
        c[k] = _mm256_add_epi32(c[k], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], v[k]), s));
#endif
      } else {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        c[k] = _mm256_dpbusd_epi32(c[k], u[k], v[k]);
#endif
      }
    }
  }
  __m256i t = c[0];
  for (int k = 1; k < 8; k++) t = _mm256_add_epi32(t, c[k]);
  j->out = _mm256_extract_epi32(t, 0);
  return NULL;
}

/* `threads` threads, each n iterations of 8 chained steps of 32 products; kind 0: maddubs + dpwssd, 1: dpbusd.
 * Returns 0, or -1 where this CPU lacks the instructions. */
int int8_dot(long n, int kind, int threads) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
  if (kind == 1) return -1;
#endif
  pthread_t tid[64];
  dot_job_t jobs[64];
  if (threads > 64) threads = 64;
  for (int t = 0; t < threads; t++) {
    jobs[t].n = n, jobs[t].kind = kind;
    pthread_create(&tid[t], NULL, dot_chains, &jobs[t]);
  }
  for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
  return 0;
}
#else
int int8_dot(long n, int kind, int threads) { return -1; }
#endif
"""


def last_level_cache_bytes() -> int | None:
    """The largest cache of CPU 0, from Linux's sysfs (None elsewhere)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes) if sizes else None


@functools.cache
def _library():
    """read_buffer() and int8_dot() compiled for this machine (-march=native), in a temporary folder, once per
    process (bench_scale measures both three times per model file)."""
    folder = Path(tempfile.mkdtemp(prefix="tinyvllm-bandwidth-"))
    (folder / "read.c").write_text(C_SOURCE)
    subprocess.run(["clang", "-O2", "-march=native", "-shared", "-fPIC", "-pthread", "-o", str(folder / "read.so"),
                    str(folder / "read.c")], check=True)
    lib = ctypes.CDLL(str(folder / "read.so"))
    lib.read_buffer.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.read_buffer.restype = ctypes.c_float
    lib.int8_dot.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int]
    lib.int8_dot.restype = ctypes.c_int
    return lib


def measure_read_bandwidth(threads: list[int] | None = None, repeats: int = 10) -> dict:
    """Bytes/s read from memory with each thread count (default: 1 and every core), best of `repeats`.

    Returns {"bytes_per_s": {threads: B/s}, "buffer_bytes": .., "last_level_cache_bytes": ..}."""
    cores = os.cpu_count() or 1
    threads = sorted({1, cores}) if threads is None else threads
    llc = last_level_cache_bytes()
    size = max(512 * 2**20, 8 * (llc or 0))  # several times the last-level cache: every read misses it
    buf = np.ones(size // 4, dtype=np.float32)  # np.ones writes every page, so none is faulted in while timed
    lib = _library()
    out = {}
    for n in threads:
        best = float("inf")
        for _ in range(repeats + 1):  # the first call warms the threads and the TLB
            t = time.perf_counter()
            total = lib.read_buffer(buf.ctypes.data, buf.size, n)
            best = min(best, time.perf_counter() - t)
        assert total == buf.size or abs(total / buf.size - 1) < 1e-2, "the read summed the wrong values"
        out[n] = buf.nbytes / best
    return {"bytes_per_s": out, "buffer_bytes": buf.nbytes, "last_level_cache_bytes": llc}


INT8_DOT_KINDS = {"k_quants": 0, "vnni": 1}
PRODUCTS_PER_ITERATION = 8 * 32  # 8 chains, 32 u8 x s8 products each


def measure_int8_dot_rate(threads: int | None = None, iterations: int = 5_000_000, repeats: int = 5) -> dict:
    """Products/s of each integer inner step (see the top of this file) with `threads` threads (default every core),
    best of `repeats`; a step this CPU lacks is left out. Returns {"products_per_s": {kind: rate}, "threads": n}."""
    threads = threads or os.cpu_count() or 1
    lib, out = _library(), {}
    for kind, code in INT8_DOT_KINDS.items():
        if lib.int8_dot(1000, code, 1) != 0:
            continue
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            lib.int8_dot(iterations, code, threads)
            best = min(best, time.perf_counter() - t)
        out[kind] = PRODUCTS_PER_ITERATION * iterations * threads / best
    return {"products_per_s": out, "threads": threads}


def measure_device_read_bandwidth(device: str, nbytes: int = 2**30, repeats: int = 10) -> dict:
    """Bytes/s a GPU reads, measured on that device: tinygrad's own sum over a buffer of `nbytes` (far larger than
    any GPU cache), replayed as one captured graph, the device waited for before and after, best of `repeats`.
    A reduction kernel from tinygrad's optimizer is a little below the memory's peak: what the engine's own kernels
    could reach. Returns measure_read_bandwidth's shape, the one "thread" being the device."""
    from tinygrad import Device, Tensor, TinyJit

    x = Tensor.ones(nbytes // 4, device=device).contiguous().realize()
    read = TinyJit(lambda t: t.sum().realize())
    best, total = float("inf"), None
    for _ in range(repeats + 2):  # the first two calls compile and capture
        Device[device].synchronize()
        t = time.perf_counter()
        total = read(x)
        Device[device].synchronize()
        best = min(best, time.perf_counter() - t)
    assert abs(total.item() / x.numel() - 1) < 1e-2, "the read summed the wrong values"
    return {"bytes_per_s": {1: x.nbytes() / best}, "buffer_bytes": x.nbytes(), "last_level_cache_bytes": None,
            "method": f"{device}: tinygrad's sum, best of {repeats}"}


def measure_bandwidth_on(device: str) -> dict:
    """The read bandwidth of the device a run uses: the CPU's cores (AVX2 loads), or a GPU's memory."""
    if device.split(":")[0].upper() == "CPU":
        return {**measure_read_bandwidth(), "method": "CPU: AVX2 loads, best of 10"}
    return measure_device_read_bandwidth(device)


if __name__ == "__main__":
    r = measure_read_bandwidth()
    llc = r["last_level_cache_bytes"] or 0
    print(f"buffer {r['buffer_bytes'] / 2**20:.0f} MiB (last-level cache {llc / 2**20:.0f} MiB)")
    for n, bps in r["bytes_per_s"].items():
        print(f"{n} thread{'s' if n > 1 else ''}: {bps / 1e9:.1f} GB/s")
    dots = measure_int8_dot_rate()
    for kind, rate in dots["products_per_s"].items():
        print(f"int8 products, {kind} step, {dots['threads']} threads: {rate / 1e9:.0f} G/s "
              f"({2 * rate / 1e9:.0f} GOP/s)")
