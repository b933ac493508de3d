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
 *     From TV_PACK_MIN_M rows on, with AVX-512F, the packed tile (below): 512-bit FMAs, each register two rows of
 *     w side by side, 6 x 8 outputs: twice the floats per FMA instruction (benchmarks/bench_linear.py times both;
 *     below ~24 rows, copying w into its packed order costs more than it saves: the weights stream from memory).
 *     Every output is the same 8-lane sum over K and the same horizontal sum whatever the tile, so the tile never
 *     changes a bit (batch invariance: tests/kernels/test_linear.py).
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
#if defined(TV_TILE_MR) || defined(TV_TILE_NR)
#define TV_TILE_GIVEN 1  /* a benchmark or test chose the tile: the packed tile below stays off */
#endif
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
/* many rows of x with AVX-512F: w packed by pairs of rows into 512-bit registers (see "the packed tile" below) */
#ifndef TV_PACK_MIN_M
#define TV_PACK_MIN_M 24  /* below, packing costs more than it saves (the weights stream from memory once) */
#endif
#if defined(__AVX512F__) && TV_M > 1 && TV_M >= TV_PACK_MIN_M && !defined(TV_TILE_GIVEN)
#define TV_PACKED 1
#define PMR 6                                      /* rows of x per packed tile */
#define PNR 8                                      /* rows of w per packed tile: 4 registers of two rows each */
#undef NR
#define NR PNR                                     /* the chunks hold whole packed tiles */
#else
#define TV_PACKED 0
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

#if TV_PACKED
/* ---- the packed tile: many rows of x on a CPU with AVX-512F ----
 * The 6 x 4 tile above does 24 FMAs of 8 floats per step of K; an AVX-512 FMA does 16 floats. To use them without
 * changing a bit, each 512-bit register holds TWO outputs' 8-lane accumulators, rows j and j+1 of w side by side:
 *     acc[i][p] (16 lanes) = [ 8 lanes of dot(x_i, w_2p) | 8 lanes of dot(x_i, w_2p+1) ]
 *     acc[i][p] = fma(x_i[k..k+8] in both halves, [w_2p[k..k+8] | w_2p+1[k..k+8]], acc[i][p])
 * Lane l of each half sums x[k+l] w[k+l] over k in order, as float_tile's 8-lane accumulator does, and the halves
 * are summed by the same hsum_f8 and K % 8 leftover: every output has the same bits as on the 6 x 4 tile, at
 * M = 1 and on AVX2 (tests/kernels/test_linear.py). The pairs of rows need w reordered: each chunk's rows are
 * copied once into `panel`, PNR rows at a time, step of K by step, [w_n[k..k+8] | w_n+1[k..k+8]] ...
 * [w_n+6 | w_n+7] (PNR x K floats per tile column, read from L1/L2 by every tile of the column), so that each
 * register of w is one aligned 64-byte load. A tile of PMR x PNR = 6 x 8 outputs: 24 accumulators + 4 w + 1 x =
 * 29 of the 32 zmm registers, 10 loads per 24 FMAs of 16 floats. */
#define KV (TV_K / 8)                              /* whole steps of 8 floats along K */
typedef float f16x __attribute__((vector_size(64), aligned(64)));
/* clang splits 64-byte vectors into two 256-bit halves on CPUs where it prefers 256-bit code (-march=native on
 * Intel's AVX-512 server cores), unless the function asks for 512-bit registers: */
#define TV_ZMM __attribute__((min_vector_width(512)))

/* panel <- rows n..n+PNR of w, by pairs of rows per step of 8 floats of K */
TV_INLINE TV_ZMM void pack_rows(float* restrict panel, const float* restrict w) {
  for (int kv = 0; kv < KV; kv++)
    for (int p = 0; p < PNR / 2; p++) {
      f8 lo = *(const f8*)(w + (2 * p) * TV_K + 8 * kv), hi = *(const f8*)(w + (2 * p + 1) * TV_K + 8 * kv);
      *(f16x*)(panel + (kv * (PNR / 2) + p) * 16) =
          __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    }
}

/* out[i, j] for i < mr, j < PNR: rows of x against one packed tile column (w: its rows, for the K % 8 leftover) */
TV_INLINE TV_ZMM void packed_tile(float* restrict out, const float* restrict x, const float* restrict panel,
                                  const float* restrict w, int mr) {
  f16x acc[PMR][PNR / 2];
  for (int i = 0; i < mr; i++)
    for (int p = 0; p < PNR / 2; p++) acc[i][p] = (f16x){0};
  for (int kv = 0; kv < KV; kv++) {
    f16x wv[PNR / 2];
    for (int p = 0; p < PNR / 2; p++) wv[p] = *(const f16x*)(panel + (kv * (PNR / 2) + p) * 16);
    for (int i = 0; i < mr; i++) {
      f8 x8 = *(const f8*)(x + i * TV_K + 8 * kv);
      f16x xv = __builtin_shufflevector(x8, x8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);  /* both halves */
      for (int p = 0; p < PNR / 2; p++) acc[i][p] += xv * wv[p];
    }
  }
  for (int i = 0; i < mr; i++)
    for (int p = 0; p < PNR / 2; p++)
      for (int h = 0; h < 2; h++) {
        int j = 2 * p + h;
        f8 a = h ? __builtin_shufflevector(acc[i][p], acc[i][p], 8, 9, 10, 11, 12, 13, 14, 15)
                 : __builtin_shufflevector(acc[i][p], acc[i][p], 0, 1, 2, 3, 4, 5, 6, 7);
        float s = hsum_f8(a);
        for (int kk = 8 * KV; kk < TV_K; kk++) s += x[i * TV_K + kk] * w[j * TV_K + kk];  /* K % 8 leftover */
        out[i * TV_N + j] = s;
      }
}

#define PACKED_TILE_AT(mr) packed_tile(out + m * TV_N + n, x + m * TV_K, panel, w + n * TV_K, mr)
/* output columns [n0, n1) for every row of x: the chunk's whole tiles packed once, then MB rows of x at a time
 * against each packed column; the N % PNR leftover rows of w on float_tile, one at a time */
TV_INLINE TV_ZMM void packed_chunk(float* restrict out, const float* restrict x, const float* restrict w, int n0,
                                   int n1) {
  float panel_all[CHUNK_ROWS * 8 * KV] __attribute__((aligned(64)));
  int n_packed = n0 + (n1 - n0) / PNR * PNR;
  for (int n = n0; n < n_packed; n += PNR) pack_rows(panel_all + (n - n0) * 8 * KV, w + (long)n * TV_K);
  for (int m0 = 0; m0 < TV_M; m0 += MB) {
    int m1 = m0 + MB < TV_M ? m0 + MB : TV_M;
    for (int n = n0; n < n_packed; n += PNR) {
      const float* panel = panel_all + (n - n0) * 8 * KV;
      int m = m0;
      for (; m + PMR <= m1; m += PMR) PACKED_TILE_AT(PMR);
      switch (m1 - m) {  /* a constant mr per case: each case its own unrolled tile */
        case 5: PACKED_TILE_AT(5); break;
        case 4: PACKED_TILE_AT(4); break;
        case 3: PACKED_TILE_AT(3); break;
        case 2: PACKED_TILE_AT(2); break;
        case 1: PACKED_TILE_AT(1); break;
        default: break;
      }
    }
    for (int n = n_packed; n < n1; n++) tile_column(out, x, w, n, m0, m1, 1);
  }
}
#endif

/* One chunk: output columns [n0, n1) for every row of x. */
static void matmul_chunk(const void* ctx, int chunk) {
  const struct matmul_args* a = (const struct matmul_args*)ctx;
#if TV_PACKED
  packed_chunk(a->out, a->x, a->w, chunk * CHUNK_ROWS, TV_CHUNK_END(chunk));
#else
  TV_CHUNK_COLUMNS(tile_column, chunk, a->out, a->x, a->w);
#endif
}
