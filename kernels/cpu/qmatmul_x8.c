/* out(M,N) = x(M,K) @ w(N,K)^T for 4-bit weights of 32-element blocks repacked at load, 8 rows of w side by side:
 * Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL (TV_QTYPE 2, 3, 6, 7, 20).
 *
 * Why: qmatmul.c reads one row of w at a time, as the GGUF stores it, and pays for each block of 32 weights a float
 * multiply-add and, at the end of a row, a horizontal sum, per row of w. Here 8 rows share a register, lane r of
 * every vector being row r (qmatmul_k_x8.c does the same for Q4_K, and says more): one load of 32 bytes holds 4 nibble
 * pairs of each of the 8 rows, one dpbusd multiplies them by the same 4 bytes of x (broadcast) and adds each lane's 4
 * products, the float scales of 8 rows are applied in one multiply-add, and 8 outputs leave in one store.
 * llama.cpp's CPU backend repacks Q4_0 and IQ4_NL the same way (block_q4_0x8, block_iq4_nlx8); the layout below is
 * our own.
 *
 * The layout: a group of 8 rows (n = 8G .. 8G + 7) and one block b of each, 8 x the GGUF's block bytes, reordered,
 * groups after groups, blocks in order within a group:
 *   bytes 0-15:    d[r], float16                 then (Q4_1, Q5_1) 16 bytes: m[r], float16
 *   then (Q5_0, Q5_1) 32 bytes of fifth bits, at FIFTH_AT: byte 4r + t holds in bit 4h + k the fifth bit of
 *                 element 16h + 4k + t of row r (h < 2, k < 4, t < 4), regrouped from the GGUF's u32 qh
 *   from HEAD:     byte HEAD + 32k + 4r + t = the GGUF's qs byte 4k + t of row r: lo nibble = element 4k + t,
 *                  hi nibble = element 16 + 4k + t
 * with w = d (q - 8) (Q4_0), d q + m (Q4_1), d (q - 16) (Q5_0, q = nibble + 16 fifth bit), d q + m (Q5_1),
 * d IQ4NL_VALUES[q] (IQ4_NL) (qmatmul.c's formats; tinyvllm/kernels/repack.py writes the layout). The GPU kernels
 * read the GGUF's own layout.
 *
 * Per (row of x, group, block), in int32 lanes, one per row of w, then in float, 8 rows at once:
 *   dot = sum_k u_k q_x,k   u = the nibble (Q4), nibble + 16 fifth bit (Q5; the bit moved to 16 by one shift of
 *                           its byte), IQ4NL_VALUES[nibble] + 128 (IQ4_NL: unsigned, for dpbusd)
 *   dot -= C * sum_k q_x,k   C = 8 (Q4_0: q - 8), 16 (Q5_0), 128 (IQ4_NL), 0 (Q4_1, Q5_1): the exact integer
 *                           sum_k q_w,k q_x,k
 *   out += (d * d_x) * dot  (+ m * d_x * sum_k q_x,k for Q4_1's and Q5_1's min)
 * Without VNNI, dpbusd is maddubs then madd against ones; IQ4_NL's values then stay signed and x takes their sign
 * (|pairs| <= 2 * 127 * 127 < 2^15, as in qmatmul.c), C = 0: the same integer sums.
 *
 * Arguments (M, N, K, TV_QTYPE compile-time constants):
 *   out:     (M, N) float32, written
 *   scratch: (M * K/32 * 40) uint8, written then read: x quantized (struct xblock8, below)
 *   x:       (M, K) float32, rows contiguous
 *   w:       (N/8, K/32 * 8 * block bytes) uint8, the groups above
 * Work: x quantized first, then chunks of groups on the thread pool; a tile is MR rows of x and one group (tile.h).
 */
#include "threadpool.h"
#include "qdot.h"

#if !defined(TV_M) || !defined(TV_N) || !defined(TV_K) || !defined(TV_QTYPE)
#error "qmatmul_x8.c needs TV_M, TV_N, TV_K and TV_QTYPE (the launcher defines them)"
#endif
#if TV_QTYPE == 2
#define BLOCK_BYTES 18
#define HEAD 16
#define C_VNNI 8
#elif TV_QTYPE == 3
#define BLOCK_BYTES 20
#define HEAD 32
#define C_VNNI 0
#elif TV_QTYPE == 6
#define BLOCK_BYTES 22
#define FIFTH_AT 16
#define HEAD 48
#define C_VNNI 16
#elif TV_QTYPE == 7
#define BLOCK_BYTES 24
#define FIFTH_AT 32
#define HEAD 64
#define C_VNNI 0
#elif TV_QTYPE == 20
#define BLOCK_BYTES 18
#define HEAD 16
#define C_VNNI 128
#else
#error "qmatmul_x8.c computes TV_QTYPE 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1) and 20 (IQ4_NL)"
#endif
#define MIN_STORED (TV_QTYPE == 3 || TV_QTYPE == 7)  /* w = d q + m: m's 8 float16 after d's */
#if TV_K % 32 != 0 || TV_N % 8 != 0
#error "K must be a multiple of the 32-element block, N of the 8-row group"
#endif
/* C: what dot has on top of sum q_w q_x (IQ4_NL's values are kept signed without VNNI: nothing on top) */
#if TV_QTYPE == 20 && !TV_VNNI
#define C_SHIFT 0
#else
#define C_SHIFT C_VNNI
#endif

#define GROUP_BLOCK_BYTES (8 * BLOCK_BYTES)  /* 8 rows' blocks */
#define NB (TV_K / 32)
#define ROW_BYTES (NB * BLOCK_BYTES)         /* one row's share of a group: tile.h steps w by it per row of w */
#define MR (TV_M == 1 ? 1 : 4)               /* rows of x per tile (of one group) */
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

/* 32 elements of x, quantized (qdot.h): x ~= d * q, and the integer sum of q (the C and min terms need it) */
struct xblock8 {
  float d;
  int sum;
  signed char q[32];
};
_Static_assert(sizeof(struct xblock8) == 40, "qlinear.X_BLOCK_BYTES['qmatmul'] says 40 per block");

struct qmatmul_args {
  float* out;
  struct xblock8* xq;  /* (M, NB) */
  const float* x;
  const unsigned char* w;
};

static void quantize_chunk(const void* ctx, int chunk);
static void qmatmul_chunk(const void* ctx, int chunk);

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL qmatmul_x8(float* restrict out, unsigned char* restrict scratch, const float* restrict x,
                     const unsigned char* restrict w) {
  struct qmatmul_args args = {out, (struct xblock8*)scratch, x, w};
  tv_parallel_for(quantize_chunk, &args, NUM_QUANT_CHUNKS);
  tv_parallel_for(qmatmul_chunk, &args, NUM_CHUNKS);
}

static void quantize_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  for (int m = chunk * QUANT_ROWS; m < TV_M && m < (chunk + 1) * QUANT_ROWS; m++)
    for (int b = 0; b < NB; b++) {
      struct xblock8* out = a->xq + m * NB + b;
      const float* xb = a->x + m * TV_K + 32 * b;
      float max = max_abs(xb, 32);
      out->sum = quantize_32(out->q, xb, max != 0.0f ? 127.0f / max : 0.0f);
      out->d = max / 127.0f;
    }
}

#if TV_AVX2
/* out[i, n + r] = dot(x[i, :], w[n + r, :]) for i < mr, r < 8: the group at w (nr is always 8: one group) */
TV_INLINE void tile(float* restrict out, const struct xblock8* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  (void)nr;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
#if TV_QTYPE == 20
  const __m256i values = _mm256_broadcastsi128_si256(_mm_setr_epi8(IQ4NL_VALUES));
#if TV_VNNI
  const __m256i unsigned_values = _mm256_xor_si256(values, _mm256_set1_epi8((char)0x80));  /* value + 128 */
#endif
#endif
  __m256 acc[MR];
  for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
  for (int b = 0; b < NB; b++) {
    const unsigned char* g = w + b * GROUP_BLOCK_BYTES;
#ifdef FIFTH_AT
    const __m256i fifth = _mm256_loadu_si256((const __m256i*)(g + FIFTH_AT));
#endif
    __m256i dot[MR];
    for (int i = 0; i < mr; i++) dot[i] = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {  /* elements 4k .. 4k + 3 (lo nibbles) and 16 + 4k .. (hi), all 8 rows */
      __m256i raw = _mm256_loadu_si256((const __m256i*)(g + HEAD + 32 * k));
      __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
#ifdef FIFTH_AT
      /* bit k (lo) and bit 4 + k (hi) of each byte to bit 4: 16-bit shifts, one bit per byte, none crosses a byte */
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(fifth, _mm256_set1_epi8((char)(1 << k))), 4 - k));
      hi = _mm256_or_si256(hi, _mm256_srli_epi16(_mm256_and_si256(fifth, _mm256_set1_epi8((char)(16 << k))), k));
#endif
#if TV_QTYPE == 20 && TV_VNNI
      lo = _mm256_shuffle_epi8(unsigned_values, lo);
      hi = _mm256_shuffle_epi8(unsigned_values, hi);
#elif TV_QTYPE == 20
      __m256i vlo = _mm256_shuffle_epi8(values, lo), vhi = _mm256_shuffle_epi8(values, hi);
      lo = _mm256_abs_epi8(vlo);
      hi = _mm256_abs_epi8(vhi);
#endif
      for (int i = 0; i < mr; i++) {
        const signed char* xq = x[i * NB + b].q + 4 * k;
        __m256i xlo = broadcast4(xq), xhi = broadcast4(xq + 16);
#if TV_QTYPE == 20 && !TV_VNNI
        xlo = _mm256_sign_epi8(xlo, vlo);  /* the value's sign moved onto x: |value| is the unsigned side */
        xhi = _mm256_sign_epi8(xhi, vhi);
#endif
        dot[i] = dot4_add(dot4_add(dot[i], lo, xlo), hi, xhi);
      }
    }
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
#if MIN_STORED
    __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 16)));
#endif
    for (int i = 0; i < mr; i++) {
      const struct xblock8* xb = x + i * NB + b;
      __m256i exact = _mm256_sub_epi32(dot[i], _mm256_set1_epi32(C_SHIFT * xb->sum));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb->d)), _mm256_cvtepi32_ps(exact), acc[i]);
#if MIN_STORED
      acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb->d * (float)xb->sum), acc[i]);
#endif
    }
  }
  for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * TV_N, acc[i]);
}

#else  /* portable C: the same sums, one product at a time */

TV_INLINE void tile(float* restrict out, const struct xblock8* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  (void)nr;
#if TV_QTYPE == 20
  static const signed char values[16] = {IQ4NL_VALUES};
#endif
  for (int i = 0; i < mr; i++)
    for (int r = 0; r < 8; r++) {
      float acc = 0.0f;
      for (int b = 0; b < NB; b++) {
        const unsigned char* g = w + b * GROUP_BLOCK_BYTES;
        const struct xblock8* xb = x + i * NB + b;
        int dot = 0;
        for (int e = 0; e < 32; e++) {  /* element e: chunk k = (e % 16) / 4, byte t = e % 4, nibble e / 16 */
          unsigned char byte = g[HEAD + 32 * ((e % 16) / 4) + 4 * r + e % 4];
          int q = e < 16 ? byte & 0x0f : byte >> 4;
#ifdef FIFTH_AT
          q |= (g[FIFTH_AT + 4 * r + e % 4] >> (4 * (e / 16) + (e % 16) / 4) & 1) << 4;
#endif
#if TV_QTYPE == 2
          q -= 8;
#elif TV_QTYPE == 6
          q -= 16;
#elif TV_QTYPE == 20
          q = values[q];
#endif
          dot += q * xb->q[e];
        }
        acc += f16_to_f32(g + 2 * r) * xb->d * (float)dot;
#if MIN_STORED
        acc += f16_to_f32(g + 16 + 2 * r) * (xb->d * (float)xb->sum);
#endif
      }
      out[i * TV_N + r] = acc;
    }
}
#endif

TV_TILE_COLUMN_FN(tile_column, tile, struct xblock8, NB, unsigned char, ROW_BYTES)

/* One chunk: output columns [n0, n1), whole groups, for every row of x (tile.h's loops, as qmatmul_k_x8.c) */
static void qmatmul_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  TV_CHUNK_COLUMNS(tile_column, chunk, a->out, a->xq, a->w);
}
