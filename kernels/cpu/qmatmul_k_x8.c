/* out(M,N) = x(M,K) @ w(N,K)^T for Q4_K weights repacked at load, 8 rows of w side by side (TV_QTYPE 12).
 *
 * Why: qmatmul_k.c reads one row of w at a time, as the GGUF stores it. Each 256 weights cost it a scale unpack,
 * two float multiply-adds and a horizontal sum of 8 lanes, per row of w: at M = 1 one core computes about as fast
 * as memory delivers, so decode is bound by instructions, not bytes. Here 8 rows of w share a register: lane r of
 * every vector is row r. One load of 32 bytes holds 4 nibble pairs of each of the 8 rows; one dpbusd multiplies
 * them by the same 4 bytes of x (broadcast) and adds each lane's 4 products. The scales, already unpacked at load,
 * are applied once per 32 weights with one integer multiply for all 8 rows, the float scales once per super-block,
 * and the 8 outputs leave in one store: no horizontal sums. llama.cpp's CPU backend does the same for Q4_K
 * (its block_q4_Kx8); the layout below is our own.
 *
 * The layout: a group of 8 rows (n = 8G .. 8G + 7) and one super-block b of each, 1152 bytes (8 x 144: the
 * GGUF's bytes exactly, reordered), groups after groups, super-blocks in order within a group:
 *   bytes    0-15: d[r], f16                     bytes 16-31: dmin[r], f16
 *   bytes   32-95: byte 32 + 8j + r: lo nibble = low 4 bits of sc[r][j], hi nibble = low 4 bits of m[r][j]
 *   bytes  96-127: i = 8j + r, byte 96 + i % 32, nibble i / 32: bits 0-1 = sc[r][j] >> 4, bits 2-3 = m[r][j] >> 4
 *   bytes 128-1151: byte 128 + 32 (8c + g) + 4r + t = the GGUF's qs byte 32c + 4g + t of row r (c, g, t < 4, 8, 4):
 *                   lo nibble = element 4g + t of sub-block 2c, hi nibble = element 4g + t of sub-block 2c + 1
 * with w = d * sc[j] * q - dmin * m[j] for sub-block j (qmatmul_k.c's Q4_K; tinyvllm/kernels/repack.py writes it).
 * The GPU kernels read the GGUF's own layout: this reordering is the CPU's, made where the weights are loaded.
 *
 * Per (row of x, group, super-block), in int32 lanes, one per row of w:
 *   sum_j sc[j] * (sum_{k in j} q q_x)   each sub-block's sum from 8 dpbusd, then one multiply by its scales
 *   sum_j m[j] * (bsums[2j] + bsums[2j + 1])   the mins, from x's bsums (as qmatmul_k.c)
 *   out += d_x * (d * dot - dmin * mins)        in float, 8 rows at once
 * Without VNNI, dpbusd is maddubs then madd against ones: the same int32 sums (|pairs| <= 2 * 15 * 127 < 2^15).
 *
 * Arguments (M, N, K, TV_QTYPE compile-time constants):
 *   out:     (M, N) float32, written
 *   scratch: (M * K/256 * 292) uint8, written then read: x quantized (qdot.h's struct xblock_k)
 *   x:       (M, K) float32, rows contiguous
 *   w:       (N/8, K/256 * 1152) uint8, the groups above
 * Work: x quantized first (as qmatmul_k.c), then chunks of groups on the thread pool; a tile is MR rows of x and
 * one group (tile.h's loops, a group's 8 rows as its NR = 8 rows of w).
 */
#include "threadpool.h"
#include "qdot.h"

#if !defined(TV_M) || !defined(TV_N) || !defined(TV_K) || !defined(TV_QTYPE)
#error "qmatmul_k_x8.c needs TV_M, TV_N, TV_K and TV_QTYPE (the launcher defines them)"
#endif
#if TV_QTYPE != 12
#error "qmatmul_k_x8.c computes TV_QTYPE 12 (Q4_K)"
#endif
#if TV_K % 256 != 0 || TV_N % 8 != 0
#error "K must be a multiple of the 256-element super-block, N of the 8-row group"
#endif

#define GROUP_BLOCK_BYTES 1152  /* 8 rows' super-blocks */
#define NB (TV_K / 256)
#define ROW_BYTES (NB * 144)    /* one row's share of a group: tile.h steps w by it per row of w */
#define MR (TV_M == 1 ? 1 : 4)  /* rows of x per tile (of one group) */
#define NR 8
#define MB 64
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (TV_M == 1 ? TV_STREAM_CHUNK_BYTES(TV_N, ROW_BYTES) : 24576)
#endif
#define CHUNK_GROUPS ((CHUNK_BYTES + 8 * ROW_BYTES - 1) / (8 * ROW_BYTES))  /* at least one */
#define CHUNK_ROWS (CHUNK_GROUPS * 8)
#define NUM_CHUNKS ((TV_N + CHUNK_ROWS - 1) / CHUNK_ROWS)
#define QUANT_ROWS 16
#define NUM_QUANT_CHUNKS ((TV_M + QUANT_ROWS - 1) / QUANT_ROWS)
#include "tile.h"

struct qmatmul_args {
  float* out;
  struct xblock_k* xq;  /* (M, NB) */
  const float* x;
  const unsigned char* w;
};

static void quantize_chunk(const void* ctx, int chunk);
static void qmatmul_chunk(const void* ctx, int chunk);

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL qmatmul_k_x8(float* restrict out, unsigned char* restrict scratch, const float* restrict x,
                       const unsigned char* restrict w) {
  struct qmatmul_args args = {out, (struct xblock_k*)scratch, x, w};
  tv_parallel_for(quantize_chunk, &args, NUM_QUANT_CHUNKS);
  tv_parallel_for(qmatmul_chunk, &args, NUM_CHUNKS);
}

static void quantize_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  for (int m = chunk * QUANT_ROWS; m < TV_M && m < (chunk + 1) * QUANT_ROWS; m++)
    for (int b = 0; b < NB; b++) quantize_block_k(a->xq + m * NB + b, a->x + m * TV_K + 256 * b);
}

/* The group's 6-bit scales and mins as bytes: sc[8j + r], m[8j + r] */
TV_INLINE void decode_scales(unsigned char* restrict sc, unsigned char* restrict m, const unsigned char* restrict g) {
#if TV_AVX2
  const __m256i four = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x03);
  __m256i lo0 = _mm256_loadu_si256((const __m256i*)(g + 32)), lo1 = _mm256_loadu_si256((const __m256i*)(g + 64));
  __m256i hi = _mm256_loadu_si256((const __m256i*)(g + 96));  /* 16-bit shifts: each byte masked after */
#define TV_HIGH(shift) _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, shift), two), 4)
  _mm256_storeu_si256((__m256i*)sc, _mm256_or_si256(_mm256_and_si256(lo0, four), TV_HIGH(0)));
  _mm256_storeu_si256((__m256i*)(sc + 32), _mm256_or_si256(_mm256_and_si256(lo1, four), TV_HIGH(4)));
  _mm256_storeu_si256((__m256i*)m, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), four), TV_HIGH(2)));
  _mm256_storeu_si256((__m256i*)(m + 32),
                      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), four), TV_HIGH(6)));
#undef TV_HIGH
#else
  for (int i = 0; i < 64; i++) {
    int high = g[96 + i % 32] >> 4 * (i / 32);
    sc[i] = (unsigned char)((g[32 + i] & 0x0f) | (high & 3) << 4);
    m[i] = (unsigned char)((g[32 + i] >> 4) | (high >> 2 & 3) << 4);
  }
#endif
}

#if TV_AVX2
/* out[i, n + r] = dot(x[i, :], w[n + r, :]) for i < mr, r < 8: the group at w (nr is always 8: one group) */
TV_INLINE void tile(float* restrict out, const struct xblock_k* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  (void)nr;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256 acc[MR];
  for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
  for (int b = 0; b < NB; b++) {
    const unsigned char* g = w + b * GROUP_BLOCK_BYTES;
    unsigned char sc[64] __attribute__((aligned(32))), mn[64] __attribute__((aligned(32)));
    decode_scales(sc, mn, g);
    __m256i dot[MR], mins[MR];
    for (int i = 0; i < mr; i++) dot[i] = mins[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {  /* sub-blocks 2c (lo nibbles) and 2c + 1 (hi) */
      __m256i slo[MR], shi[MR];
      for (int i = 0; i < mr; i++) slo[i] = shi[i] = _mm256_setzero_si256();
      for (int k = 0; k < 8; k++) {  /* elements 4k .. 4k + 3 of both sub-blocks, all 8 rows */
        __m256i raw = _mm256_loadu_si256((const __m256i*)(g + 128 + 32 * (8 * c + k)));
        __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int i = 0; i < mr; i++) {
          const signed char* xq = x[i * NB + b].q + 64 * c + 4 * k;
          slo[i] = dot4_add(slo[i], lo, broadcast4(xq));
          shi[i] = dot4_add(shi[i], hi, broadcast4(xq + 32));
        }
      }
      __m256i sc0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 16 * c)));
      __m256i sc1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 16 * c + 8)));
      for (int i = 0; i < mr; i++)
        dot[i] = _mm256_add_epi32(dot[i], _mm256_add_epi32(_mm256_mullo_epi32(slo[i], sc0),
                                                           _mm256_mullo_epi32(shi[i], sc1)));
    }
    for (int j = 0; j < 8; j++) {
      __m256i mj = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mn + 8 * j)));
      for (int i = 0; i < mr; i++) {
        const short* bs = x[i * NB + b].bsums;
        mins[i] = _mm256_add_epi32(mins[i], _mm256_mullo_epi32(mj, _mm256_set1_epi32(bs[2 * j] + bs[2 * j + 1])));
      }
    }
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
    __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 16)));
    for (int i = 0; i < mr; i++) {
      __m256 dx = _mm256_set1_ps(x[i * NB + b].d);
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(dot[i]), acc[i]);
      acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins[i]), acc[i]);
    }
  }
  for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * TV_N, acc[i]);
}

#else  /* portable C: the same sums, one product at a time */

TV_INLINE void tile(float* restrict out, const struct xblock_k* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  (void)nr;
  for (int i = 0; i < mr; i++)
    for (int r = 0; r < 8; r++) {
      float acc = 0.0f;
      for (int b = 0; b < NB; b++) {
        const unsigned char* g = w + b * GROUP_BLOCK_BYTES;
        const struct xblock_k* xb = x + i * NB + b;
        unsigned char sc[64], mn[64];
        decode_scales(sc, mn, g);
        int dot = 0, mins = 0;
        for (int j = 0; j < 8; j++) {
          int s = 0;
          for (int e = 0; e < 32; e++) {  /* element e of sub-block j: chunk j / 2, nibble j % 2 */
            unsigned char byte = g[128 + 32 * (8 * (j / 2) + e / 4) + 4 * r + e % 4];
            s += (j % 2 ? byte >> 4 : byte & 0x0f) * xb->q[32 * j + e];
          }
          dot += sc[8 * j + r] * s;
          mins += mn[8 * j + r] * (xb->bsums[2 * j] + xb->bsums[2 * j + 1]);
        }
        acc += xb->d * (f16_to_f32(g + 2 * r) * (float)dot - f16_to_f32(g + 16 + 2 * r) * (float)mins);
      }
      out[i * TV_N + r] = acc;
    }
}
#endif

TV_TILE_COLUMN_FN(tile_column, tile, struct xblock_k, NB, unsigned char, ROW_BYTES)

/* One chunk: output columns [n0, n1), whole groups, for every row of x. tile.h's loops: a chunk is whole groups,
 * so its rows always come NR = 8 at a time (its one-row leftover loop never runs). */
static void qmatmul_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  TV_CHUNK_COLUMNS(tile_column, chunk, a->out, a->xq, a->w);
}
