"""The GPU kernel sources (kernels/cuda, kernels/metal) run on the CPU, under a small emulation of the GPU thread
model; and the CUDA sources compiled to PTX. For machines without a GPU: the tests of every GPU kernel use these.

The emulation compiles a `.cu` or `.metal` file as C++ after a page of shims (EMULATION below):

    grid (gx, gy) of thread blocks, one block after another; every GPU thread of a block a real pthread
    __syncthreads / threadgroup_barrier           a real barrier of the block's threads
    __dp4a                                         4 products of signed bytes, summed in int
    __byte_perm                                    4 bytes picked from 8 (the low 3 bits of each selector nibble)
    __shfl_xor_sync / simd_sum / __syncwarp        through memory, between two barriers of the warp's 32 threads
    __shared__ / threadgroup arrays                statics, shared by the block's threads
    __half (CUDA) / half (Metal)                   IEEE float16: clang's __fp16 storage type, converted by F16C
    float4 / uint4                                 16-byte aligned structs
    buffers                                        each page-aligned, as a GPU allocation is (cudaMalloc: 256 B)

Every load is checked for the alignment of its type (clang's -fsanitize=alignment, trapping): a kernel that reads
a uint4 or a float4 from an address its layout does not align fails here, not only on a GPU. The launch runs in
a child process, so a trap or a stray pointer fails the test that caused it instead of killing the test run.

What this checks: a kernel's index arithmetic, its per-thread math, its warps' reductions and merges, its float16
conversions. What it cannot: that nvrtc's or Metal's code is right (the CUDA source is compiled by
`compile_cuda`; Metal's compiler is not available off macOS), timing, or what a real GPU's memory model exposes.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tinyvllm.kernels import launcher

EMULATION = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <pthread.h>
using std::max;
using std::min;
struct uint3 { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
/* IEEE float16 as both languages see it: a 2-byte value converted to and from float (round to nearest even).
 * clang's __fp16 does the conversions; it may not be a parameter or a return value, so it is wrapped. */
struct tv_half {
  __fp16 value;
  tv_half() = default;
  tv_half(float f) : value(f) {}
  operator float() const { return value; }
};
static thread_local uint3 threadIdx, blockIdx;
static const uint3 blockDim = {TV_EMU_THREADS, 1, 1};
static pthread_barrier_t block_barrier, warp_barrier[TV_EMU_THREADS / 32];
static float lanes[TV_EMU_THREADS / 32][32];
static void warp_wait() { pthread_barrier_wait(&warp_barrier[threadIdx.x / 32]); }
static float lane_sum(float x) {  /* every lane gets the warp's sum: through memory, between warp barriers */
  lanes[threadIdx.x / 32][threadIdx.x % 32] = x;
  warp_wait();
  float total = 0.0f;
  for (int i = 0; i < 32; i++) total += lanes[threadIdx.x / 32][i];
  warp_wait();
  return total;
}
/* CUDA */
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__ __restrict
#define __shared__ static
typedef tv_half __half;
inline float __half2float(__half h) { return h; }
inline __half __float2half(float f) { return __half(f); }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline int __dp4a(int a, int b, int c) {  /* 4 signed bytes of a times those of b, summed into c */
  for (int i = 0; i < 32; i += 8) c += (signed char)(a >> i) * (signed char)(b >> i);
  return c;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  /* byte i: byte (s >> 4i) & 7 of y:x */
  const unsigned long long v = x | (unsigned long long)y << 32;
  unsigned r = 0;
  for (int i = 0; i < 4; i++) r |= (unsigned)(v >> 8 * (s >> 4 * i & 7) & 0xFF) << 8 * i;
  return r;
}
inline void __syncthreads() { pthread_barrier_wait(&block_barrier); }
inline void __syncwarp() { warp_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int offset) {
  lanes[threadIdx.x / 32][threadIdx.x % 32] = x;
  warp_wait();
  float y = lanes[threadIdx.x / 32][(threadIdx.x % 32) ^ offset];
  warp_wait();
  return y;
}
/* Metal */
#define kernel
#define device
#define constant static const  /* program-scope tables */
#define threadgroup static
#define thread  /* the address space of a thread's own variables */
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef tv_half half;
namespace metal {  /* float overloads, as Metal's: the global C ones would compute in double */
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fabs(float x) { return std::fabs(x); }
inline float rint(float x) { return std::rint(x); }
template <class T, class F> inline T as_type(F x) {
  static_assert(sizeof(T) == sizeof(F), "as_type: the same size");
  T y;
  std::memcpy(&y, &x, sizeof(T));
  return y;
}
}
namespace precise { inline float exp(float x) { return std::exp(x); } }
enum class mem_flags { mem_threadgroup };
inline void threadgroup_barrier(mem_flags) { pthread_barrier_wait(&block_barrier); }
inline void simdgroup_barrier(mem_flags) { warp_wait(); }
inline float simd_sum(float x) { return lane_sum(x); }
"""

LAUNCH = r"""
struct Launch { void** args; unsigned block_x, block_y, thread_index; };
static void* run_thread(void* p) {
  Launch* l = (Launch*)p;
  blockIdx = {l->block_x, l->block_y, 0};
  threadIdx = {l->thread_index, 0, 0};
  void** a = l->args;
  TV_EMU_CALL;
  return nullptr;
}
extern "C" void launch(void** args, unsigned grid_x, unsigned grid_y) {
  for (unsigned by = 0; by < grid_y; by++)
    for (unsigned bx = 0; bx < grid_x; bx++) {
      pthread_barrier_init(&block_barrier, nullptr, TV_EMU_THREADS);
      for (auto& b : warp_barrier) pthread_barrier_init(&b, nullptr, 32);
      pthread_t threads[TV_EMU_THREADS];
      Launch launches[TV_EMU_THREADS];
      for (unsigned t = 0; t < TV_EMU_THREADS; t++) {
        launches[t] = {args, bx, by, t};
        pthread_create(&threads[t], nullptr, run_thread, &launches[t]);
      }
      for (auto& th : threads) pthread_join(th, nullptr);
      pthread_barrier_destroy(&block_barrier);
      for (auto& b : warp_barrier) pthread_barrier_destroy(&b);
    }
}
"""

# the child process (no numpy: it starts in a fraction of the time): each array's bytes copied into its own
# page-aligned mapping, the kernel launched, every array's bytes written back
RUNNER = r"""
import ctypes, mmap, sys
lib, grid_x, grid_y, *files = sys.argv[1:]
sizes, maps = [], []
for name in files:
    with open(name, "rb") as f:
        data = f.read()
    sizes.append(len(data))
    maps.append(mmap.mmap(-1, max(len(data), 1)))
    maps[-1].write(data)
args = (ctypes.c_void_p * len(maps))(*[ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps])
ctypes.CDLL(lib).launch(args, ctypes.c_uint(int(grid_x)), ctypes.c_uint(int(grid_y)))
for name, size, m in zip(files, sizes, maps):
    with open(name, "wb") as f:
        f.write(m[:size])
"""

DEVICES = {"cuda": "CUDA", "metal": "METAL"}
C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "tv_half", np.dtype(np.int32): "int",
           np.dtype(np.uint32): "unsigned", np.dtype(np.uint8): "unsigned char", np.dtype(np.int8): "signed char"}


def can_emulate() -> bool:
    """clang++ on x86-64 Linux (F16C for float16; the emulation's threads are pthreads)."""
    return shutil.which("clang++") is not None and sys.platform == "linux" and platform.machine() == "x86_64"


def kernel_file_source(language: str, name: str, defines: dict, entry: str | None = None) -> str:
    """The text tinygrad would compile for function `entry` (default: `name`) of kernels/<language>/<name>.*:
    the `#define`s, TV_KERNEL, TV_<ENTRY> where the file holds several entries, then the file."""
    return launcher.program_source(name, DEVICES[language], defines, entry)[1]


def run_emulated_source(language: str, source: str, entry: str, arrays: list[np.ndarray], grid: tuple[int, int],
                        num_threads: int, tmp_path: Path) -> None:
    """Compile `source` (CUDA or Metal) with the emulation as C++ and run function `entry` on `grid` thread blocks
    of `num_threads` threads, its arguments `arrays` in order (each passed as a pointer to its dtype). Every array
    is written back in place, as the kernel left it."""
    if language not in DEVICES:
        raise ValueError(f"language must be one of {sorted(DEVICES)}, got {language!r}")
    if num_threads % 32 or not 32 <= num_threads <= 1024:
        raise ValueError(f"num_threads must be a multiple of 32 in 32..1024 (whole warps), got {num_threads}")
    for i, a in enumerate(arrays):
        if a.dtype not in C_TYPES or not a.flags.c_contiguous:
            raise ValueError(f"argument {i}: a C-contiguous array of {sorted(map(str, C_TYPES))} is needed, "
                             f"got {a.dtype} (contiguous: {a.flags.c_contiguous})")
    include = tmp_path / "include"
    include.mkdir(exist_ok=True)
    (include / "cuda_fp16.h").write_text("")
    (include / "metal_stdlib").write_text("")
    # Metal kernels take their block and thread index as arguments; CUDA kernels read them from globals
    call = ", ".join(f"({C_TYPES[a.dtype]}*)a[{i}]" for i, a in enumerate(arrays))
    call = f"{entry}({call}{', blockIdx, threadIdx' if language == 'metal' else ''})"
    # the kernel's own #defines first (the shims need none of them); a new file name per variant: dlopen hands
    # back an already loaded library for a path it has seen
    variant = len(list(tmp_path.glob("*.cpp")))
    cpp = tmp_path / f"{language}_{entry}_{variant}.cpp"
    cpp.write_text(f"#define TV_EMU_THREADS {num_threads}\n#define TV_EMU_CALL {call}\n"
                   + EMULATION + source + LAUNCH)
    lib = cpp.with_suffix(".so")
    subprocess.run(["clang++", "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-mf16c",
                    "-fsanitize=alignment", "-fsanitize-trap=alignment",
                    "-Wno-unknown-attributes", "-Wno-ignored-attributes", f"-I{include}", str(cpp), "-o", str(lib)],
                   check=True)
    files = [cpp.with_suffix(f".{i}.bin") for i in range(len(arrays))]
    for f, a in zip(files, arrays):
        f.write_bytes(a.tobytes())
    child = subprocess.run([sys.executable, "-c", RUNNER, str(lib), str(grid[0]), str(grid[1]), *map(str, files)],
                           capture_output=True, text=True)
    if child.returncode != 0:
        why = ""
        if child.returncode == -signal.SIGILL:
            why = " (SIGILL: a load from an address not aligned for its type)"
        elif child.returncode == -signal.SIGSEGV:
            why = " (SIGSEGV: an access outside the buffers)"
        raise AssertionError(f"emulated {language} kernel {entry} failed with exit status {child.returncode}{why}\n"
                             f"{child.stderr[-2000:]}")
    for f, a in zip(files, arrays):
        a[...] = np.frombuffer(f.read_bytes(), a.dtype).reshape(a.shape)


def run_emulated(language: str, name: str, defines: dict, arrays: list[np.ndarray], grid: tuple[int, int],
                 num_threads: int, tmp_path: Path, entry: str | None = None) -> None:
    """Run function `entry` (default: `name`) of kernels/<language>/<name>.* under the emulation, compiled with
    `defines`, as `launch` would run it on a GPU: `grid` thread blocks of `num_threads` threads on `arrays`."""
    source = kernel_file_source(language, name, defines, entry)
    run_emulated_source(language, source, entry or name, arrays, grid, num_threads, tmp_path)


# ---- CUDA: compiled to PTX here; run where a CUDA device exists ----

def _nvrtc_from_wheel() -> None:
    """Point tinygrad at libnvrtc from the nvidia-cuda-nvrtc wheel (the `test` extra), if installed and no NVRTC_PATH
    is set. tinygrad reads NVRTC_PATH once, when its nvrtc bindings are first imported (a device opening may do
    that), so this runs when this module is imported, before any test opens a device."""
    try:
        import nvidia.cuda_nvrtc as wheel
    except ImportError:
        return
    found = sorted(lib for p in wheel.__path__ for lib in (Path(p) / "lib").glob("libnvrtc.so*"))
    if found and "NVRTC_PATH" not in os.environ:
        os.environ["NVRTC_PATH"] = str(found[0])


_nvrtc_from_wheel()


def nvrtc_compiler(arch: str = "sm_90"):
    """tinygrad's own CUDA compiler (nvrtc) for `arch`, with nvrtc from the nvidia-cuda-nvrtc wheel if installed."""
    try:
        from tinygrad.runtime.support.compiler_cuda import NVRTCCompiler

        return NVRTCCompiler(arch)
    except Exception:  # no libnvrtc anywhere
        return None


def compile_cuda(source: str, tmp_path: Path, arch: str = "sm_90") -> str | None:
    """PTX for `arch` from nvrtc (tinygrad's compiler), else from `nvcc -ptx`; None where neither exists.
    A compile error raises (tinygrad's CompileError, or CalledProcessError from nvcc)."""
    compiler = nvrtc_compiler(arch)
    if compiler is not None:
        return compiler.compile(source).decode()
    if shutil.which("nvcc"):
        (tmp_path / "k.cu").write_text(source)
        subprocess.run(["nvcc", "-ptx", f"-arch={arch}", "-o", str(tmp_path / "k.ptx"), str(tmp_path / "k.cu")],
                       check=True)
        return (tmp_path / "k.ptx").read_text()
    return None


def check_ptx(ptx: str, entry: str) -> None:
    """The entry tinygrad's CUDA runtime looks up is there, and no register spilled to local memory."""
    assert f".entry {entry}(" in ptx, f"no entry {entry} in the PTX"
    assert ".local" not in ptx, "registers spilled to local memory"


def device_or_skip(name: str) -> str:
    """`name` if tinygrad can open that device here (a CUDA or Metal run of the GPU tests), else skip the test."""
    import pytest
    from tinygrad import Device

    try:
        Device[name]
    except Exception as e:  # no driver, no device
        pytest.skip(f"no {name} device ({type(e).__name__})")
    return name
