/* out(M,N) = x(M,K) @ w(N,K)^T in float32: every linear layer of the model (qkv, o, gate_up, down, lm_head).
 *
 * Why a hand-written kernel: decoding is almost nothing but these products. SmolLM2-135M reads, per token,
 *     30 layers x (qkv 960x576 + o 576x576 + gate_up 3072x576 + down 576x1536) = 30 x 3,538,944 weights
 *   + lm_head 49152x576                                                       =      28,311,552 weights
 *   = 134.5 M weights x 4 bytes = 538 MB, for 2 x 134.5 M = 0.27 GFLOP.
 * At M=1 (one sequence decoding) that is 0.5 FLOP per byte: the kernel is bound by memory bandwidth, and the
 * best it can do is stream w exactly once at the speed the cores can read (538 MB / bandwidth per token; two cores
 * read faster than one). tinygrad's generated kernels reach a fraction of that bandwidth.
 * At M=32 (32 sequences decoding together) each weight read serves 32 rows of x: 16 FLOP per byte, so the kernel
 * is bound by FMAs: 32 x 0.27 = 8.6 GFLOP per step, against 32 FLOP/cycle for one AVX2 core (2 FMA units x
 * 8 floats x 2), which tinygrad's generated kernels come nowhere near (benchmarks/bench_linear.py measures both).
 *
 * Arguments (w is stored as the model stores it, (out_features, in_features), rows contiguous):
 *   out: (M, N) float32, written
 *   x:   (M, K) float32, rows contiguous
 *   w:   (N, K) float32, rows contiguous
 * M, N, K are compile-time constants (TV_M, TV_N, TV_K): one compiled program per shape, so the loops are
 * specialised and a TinyJit replay passes nothing but the three buffer addresses.
 *
 * How the work is cut:
 *   - an output tile is MR rows of x times NR rows of w; its MR*NR dot products run together over K, 8 floats at a
 *     time (one AVX2 register), so each loaded vector of w is used MR times and each vector of x NR times.
 *     M=1: MR=1, NR=8: 8 independent accumulators; w is read once, in order, which the hardware prefetcher follows.
 *     M>1: MR=4, NR=3 -> 12 accumulators + 3 w vectors + 1 x vector = 16 registers, all of AVX2's ymm0-15.
 *     (Measured on one core at M=32: 4x3 66 GFLOP/s, 2x4 64, 4x2 61, 6x2 58, 3x4 51, 2x6 41.)
 *     With AVX-512 (AVX-512VL: 32 ymm registers, the same 256-bit FMAs) MR=6, NR=4: 24 accumulators + 4 + 1 = 29
 *     registers, 10 loads per 24 FMAs instead of 7 per 12 (on one AVX-512 core the faster at every layer's shape,
 *     against 4x3, 4x5, 8x3 and 4x6; 5x4 about the same).
 *     Every output is the same 8-lane sum over K and the same horizontal sum whatever the tile, so the tile never
 *     changes a bit (batch invariance: tests/test_kernels_linear.py).
 *   - while a tile works on w rows n..n+NR, it prefetches rows n+NR..n+2NR (the next tile) into cache, so reading
 *     w from memory overlaps the arithmetic instead of stalling the first pass over each tile (M=8: +20-40%).
 *   - the N rows of w are cut into chunks of ~48 KB of w; chunks are spread over the thread pool (threadpool.h).
 *     Inside a chunk, for each block of MB rows of x, each w tile is loaded from memory once and then reused
 *     from L1 for every row of x, while x (MB x K floats, <= 400 KB) stays in L2.
 */
#include "threadpool.h"

#if !defined(TV_M) || !defined(TV_N) || !defined(TV_K)
#error "matmul.c needs TV_M, TV_N and TV_K (the launcher defines them)"
#endif

#if TV_M == 1
#define MR 1
#define NR 8
#else
#if defined(__AVX512VL__)  /* AVX-512's 32 vector registers hold a 6 x 4 tile of 256-bit accumulators */
#define TILE_MR_DEFAULT 6
#define TILE_NR_DEFAULT 4
#else
#define TILE_MR_DEFAULT 4
#define TILE_NR_DEFAULT 3
#endif
#ifndef TV_TILE_MR  /* (a benchmark may set the tile: every output is computed the same way whatever it is) */
#define TV_TILE_MR TILE_MR_DEFAULT
#endif
#ifndef TV_TILE_NR
#define TV_TILE_NR TILE_NR_DEFAULT
#endif
#define MR TV_TILE_MR
#define NR TV_TILE_NR
#endif
#define MB 64                                      /* rows of x per block: 64 x 1536 x 4 B = 393 KB, fits L2 */
#define CHUNK_BYTES 49152                          /* ~48 KB of w per chunk handed to a thread */
#define CHUNK_TILES ((CHUNK_BYTES / (4 * TV_K) + NR - 1) / NR > 0 ? (CHUNK_BYTES / (4 * TV_K) + NR - 1) / NR : 1)
#define CHUNK_ROWS (CHUNK_TILES * NR)
#define NUM_CHUNKS ((TV_N + CHUNK_ROWS - 1) / CHUNK_ROWS)
#include "tile.h"  /* after MR, NR, MB, CHUNK_ROWS: its tile and loops are cut by them */

struct matmul_args {
  float* out;
  const float* x;
  const float* w;
};

static void matmul_chunk(const void* ctx, int chunk);

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL matmul(float* restrict out, const float* restrict x, const float* restrict w) {
  struct matmul_args args = {out, x, w};
  tv_parallel_for(matmul_chunk, &args, NUM_CHUNKS);
}

/* the next tile's rows of w are prefetched when tiles have rows to share them (MR > 1) */
#define MATMUL_TILE(out, x, w, mr, nr) float_tile(out, x, w, mr, nr, MR > 1)
TV_TILE_COLUMN_FN(tile_column, MATMUL_TILE, float, TV_K, float, TV_K)

/* One chunk: output columns [n0, n1) for every row of x. */
static void matmul_chunk(const void* ctx, int chunk) {
  const struct matmul_args* a = (const struct matmul_args*)ctx;
  TV_CHUNK_COLUMNS(tile_column, chunk, a->out, a->x, a->w);
}
