/* out(M,N) = x(M,K) @ w(N,K)^T, w kept in a 256-element GGUF super-block format: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or
 * IQ4_XS (TV_QTYPE 10, 11, 12, 13, 14, 23).
 *
 * Why: the K-quants are what most downloaded GGUFs hold (a Q4_K_M file is Q4_K with some tensors in Q6_K).
 * They pack 256 weights into a super-block with ONE float16 scale, and give each 16 or 32 of them a small
 * integer scale of their own: 2.6 to 6.6 bits per weight against float32's 32. The integer sub-block scales
 * let the whole super-block stay in integers: one float multiply per 256 weights.
 *
 * The super-blocks (tinyvllm/model/quant.py draws them byte by byte):
 *   Q2_K  84 bytes: sc/m[16] (4 bits each), 64 bytes of 2-bit q, d, dmin (f16)
 *        16 sub-blocks of 16: w = d * sc[s] * q - dmin * m[s], q in 0..3
 *   Q3_K 110 bytes: hmask[32] (the high bit), 64 bytes of 2 low bits, 12 bytes of 6-bit sc[16], d (f16)
 *        16 sub-blocks of 16: w = d * (sc[s] - 32) * (q - 4), q in 0..7
 *   Q4_K 144 bytes: d, dmin (f16), 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes of nibbles q in 0..15
 *        8 sub-blocks of 32:  w = d * sc[s] * q - dmin * m[s]
 *        (qs byte 32c + l: lo nibble = element l of sub-block 2c, hi nibble = element l of sub-block 2c + 1)
 *   Q5_K 176 bytes: Q4_K's, and qh[32]: bit s of qh[l] is the fifth bit of element l of sub-block s; q in 0..31
 *   Q6_K 210 bytes: ql[128] (4 low bits), qh[64] (2 high bits), int8 sc[16], d (f16)
 *        16 sub-blocks of 16: w = d * sc[s] * (q - 32), q in 0..63
 *   IQ4_XS 136 bytes: d (f16), 6-bit sc[8] (u16 of high bits, 4 bytes of low nibbles), 8 x 16 bytes of nibbles
 *        8 sub-blocks of 32: w = d * (sc[s] - 32) * IQ4NL_VALUES[q] (qdot.h), each packed as a Q4_0 block
 *
 * Route (llama.cpp's ggml-cpu: x as block_q8_K, vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K; our own code):
 *   1. each row of x, once, into `scratch`: per 256 floats d_x = max|x| / 127, q_x = rint(x / d_x) (int8), and
 *      the sum of each 16 q_x (bsums)                                                  (struct xblock_k, 292 bytes)
 *   2. per super-block of one row of x and one row of w, all in int32:
 *        Q4_K:  dot ~= d_x * (d * sum_s sc[s] * sum_{k in s} q q_x  -  dmin * sum_s m[s] * sum_{k in s} q_x)
 *        Q6_K:  dot ~= d_x * d * sum_s sc[s] * (sum_{k in s} q q_x  -  32 * sum_{k in s} q_x)
 *      sum_{k in s} q_x is two bsums, so the min and the -32 cost one madd per super-block, not one per weight
 *      (Q2_K, Q5_K: as Q4_K; Q3_K: as Q6_K with -4; IQ4_XS: its values signed, x takes their signs as qmatmul.c's).
 *      AVX2: _mm256_maddubs_epi16 (32 u8 x i8 products, pairs added: |.| <= 2*63*127 < 2^15), then
 *      _mm256_madd_epi16 against the sub-block scales instead of ones: the scale is applied in integers.
 *
 * Arguments (M, N, K, TV_QTYPE compile-time constants: one program per shape and format):
 *   out:     (M, N) float32, written
 *   scratch: (M * K/256 * 292) uint8, written then read: x quantized (qlinear.scratch_bytes)
 *   x:       (M, K) float32, rows contiguous
 *   w:       (N, K/256 * block bytes) uint8, the GGUF's super-blocks, row after row
 * Work is cut as in qmatmul.c: x quantized first, then tiles over chunks of w rows on the thread pool. M=1: one
 * row of w at a time (one stream from memory, see qmatmul.c). M>1: MR=4 rows of x per row of w. Unlike qmatmul.c
 * there is no float path for many rows: with the scales inside the integer sums, a super-block costs ~3
 * instructions per 32 products and row pair (maddubs, madd, add), and one core measured at M=32, 576x1536, in
 * cache: Q4_K 127 GFLOP/s, Q6_K 115, against 85 dequantizing to float32 and ~100 for matmul.c (AVX2 registers
 * only: 97 and 91; 4x1 beat 2x2, 3x2, 2x1 and 8x1 there).
 */
#include "threadpool.h"
#include "qdot.h"

#if !defined(TV_M) || !defined(TV_N) || !defined(TV_K) || !defined(TV_QTYPE)
#error "qmatmul_k.c needs TV_M, TV_N, TV_K and TV_QTYPE (the launcher defines them)"
#endif
/* Each format's traits: BLOCK_BYTES; HAS_MINS: w = d sc q - dmin m per sub-block (the min term from x's bsums);
 * Q_OFFSET_SHIFT: w = d sc (q - 2^Q_OFFSET_SHIFT) with q stored unsigned (the offset from x's bsums, in integers). */
#if TV_QTYPE == 10
#define BLOCK_BYTES 84    /* Q2_K: 16 sub-blocks of 16, 4-bit scales and mins */
#define HAS_MINS 1
#elif TV_QTYPE == 11
#define BLOCK_BYTES 110   /* Q3_K: 16 sub-blocks of 16, 6-bit scales; q = low 2 bits | high bit << 2, minus 4 */
#define Q_OFFSET_SHIFT 2
#elif TV_QTYPE == 12
#define BLOCK_BYTES 144
#define HAS_MINS 1
#elif TV_QTYPE == 13
#define BLOCK_BYTES 176
#define HAS_MINS 1
#elif TV_QTYPE == 14
#define BLOCK_BYTES 210
#define Q_OFFSET_SHIFT 5  /* q - 32 */
#elif TV_QTYPE == 23
#define BLOCK_BYTES 136   /* IQ4_XS: w = d (sc - 32) IQ4NL_VALUES[q], signed: x takes w's signs (qmatmul.c's Q8_0) */
#else
#error "qmatmul_k.c computes TV_QTYPE 10 (Q2_K), 11 (Q3_K), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K), 23 (IQ4_XS)"
#endif
#ifndef HAS_MINS
#define HAS_MINS 0
#endif
#ifdef Q_OFFSET_SHIFT
#define Q_OFFSET (1 << Q_OFFSET_SHIFT)
#else
#define Q_OFFSET 0
#endif
#if TV_K % 256 != 0
#error "K must be a multiple of the 256-element super-block"
#endif

#define QS_AT (TV_QTYPE == 13 ? 48 : 16)   /* Q4_K, Q5_K: where the nibbles start */
#define NB (TV_K / 256)                    /* super-blocks per row */
#define ROW_BYTES (NB * BLOCK_BYTES)
#ifndef TV_TILE_NR
#define TV_TILE_NR 1
#endif
#ifndef TV_TILE_MR
#define TV_TILE_MR 4
#endif
#if TV_M == 1
#define MR 1
#define NR TV_TILE_NR
#else
#define MR TV_TILE_MR
#define NR TV_TILE_NR
#endif
#define MB 64
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (TV_M == 1 ? TV_STREAM_CHUNK_BYTES(TV_N, ROW_BYTES) : 24576)
#endif
#ifndef STREAM_PREFETCH
#define STREAM_PREFETCH 2048
#endif
#define CHUNK_TILES ((CHUNK_BYTES / ROW_BYTES + NR - 1) / NR > 0 ? (CHUNK_BYTES / ROW_BYTES + NR - 1) / NR : 1)
#define CHUNK_ROWS (CHUNK_TILES * NR)
#define NUM_CHUNKS ((TV_N + CHUNK_ROWS - 1) / CHUNK_ROWS)
#define QUANT_ROWS 16
#define NUM_QUANT_CHUNKS ((TV_M + QUANT_ROWS - 1) / QUANT_ROWS)
#include "tile.h"  /* after MR, NR, MB, CHUNK_ROWS: its loops are cut by them */

struct qmatmul_args {
  float* out;
  struct xblock_k* xq;  /* (M, NB) */
  const float* x;
  const unsigned char* w;
};

static void quantize_chunk(const void* ctx, int chunk);
static void qmatmul_chunk(const void* ctx, int chunk);

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL qmatmul_k(float* restrict out, unsigned char* restrict scratch, const float* restrict x,
                    const unsigned char* restrict w) {
  struct qmatmul_args args = {out, (struct xblock_k*)scratch, x, w};
  tv_parallel_for(quantize_chunk, &args, NUM_QUANT_CHUNKS);  /* every row of x, before any dot product */
  tv_parallel_for(qmatmul_chunk, &args, NUM_CHUNKS);
}

/* ---- step 1: x -> 8-bit super-blocks ---- */

static void quantize_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  for (int m = chunk * QUANT_ROWS; m < TV_M && m < (chunk + 1) * QUANT_ROWS; m++)
    for (int b = 0; b < NB; b++) quantize_block_k(a->xq + m * NB + b, a->x + m * TV_K + 256 * b);
}

/* ---- step 2: integer dot products per super-block ---- */

/* A super-block's integer scales, unpacked once per row of w and used for every row of x:
 *   sc[s]: the scale of sub-block s (Q4_K: 8 of 32 weights, 6 bits; Q6_K: 16 of 16, int8)
 *   sc16[g]: the scale of each 16 weights (Q4_K: sc[g / 2]; Q6_K: sc[g]), beside x's bsums[g]
 *   m16[g]: Q4_K's min of each 16 weights, m[g / 2]                                                  */
struct wscales {
  float d, dmin;
  short sc16[16];
  short m16[16];
};

TV_INLINE void unpack_scales(struct wscales* restrict s, const unsigned char* restrict blk) {
#if TV_QTYPE == 10
  for (int g = 0; g < 16; g++) {  /* byte g: the scale in its lo nibble, the min in its hi */
    s->sc16[g] = (short)(blk[g] & 0x0f);
    s->m16[g] = (short)(blk[g] >> 4);
  }
  s->d = f16_to_f32(blk + 80);
  s->dmin = f16_to_f32(blk + 82);
#elif TV_QTYPE == 11
  const unsigned char* p = blk + 96;  /* 12 bytes: see quant.py's _q3_k_scales */
  for (int g = 0; g < 16; g++) {
    int sc = (p[g % 8] >> 4 * (g / 8) & 0x0f) | (p[8 + g % 4] >> 2 * (g / 4) & 3) << 4;
    s->sc16[g] = (short)(sc - 32);
    s->m16[g] = 0;
  }
  s->d = f16_to_f32(blk + 108);
  s->dmin = 0.0f;
#elif (TV_QTYPE == 12 || TV_QTYPE == 13) && TV_AVX2
  /* the 12 bytes as three u32 (4 sub-blocks a lane, byte by byte): bytes 0-3 sc[0..3] and 2 high bits of sc[4..7],
   * 4-7 m[0..3] and 2 high bits of m[4..7], 8-11 the low nibbles of sc[4..7] (lo) and m[4..7] (hi) */
  unsigned int a, b, c;
  __builtin_memcpy(&a, blk + 4, 4), __builtin_memcpy(&b, blk + 8, 4), __builtin_memcpy(&c, blk + 12, 4);
  const unsigned int six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  __m128i sc_m = _mm_setr_epi32((int)(a & six), (int)((c & four) | (a >> 6 & two) << 4),
                                (int)(b & six), (int)((c >> 4 & four) | (b >> 6 & two) << 4));  /* sc[8], m[8] */
  /* one vector store each (a later vector load of them is forwarded; scalar stores would stall it) */
  _mm256_storeu_si256((__m256i*)s->sc16, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc_m, sc_m)));
  _mm256_storeu_si256((__m256i*)s->m16, _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sc_m, sc_m)));
  s->d = f16_to_f32(blk);
  s->dmin = f16_to_f32(blk + 2);
#elif TV_QTYPE == 12 || TV_QTYPE == 13
  const unsigned char* p = blk + 4;  /* 12 bytes: see quant.py's _k_scales_mins */
  for (int j = 0; j < 8; j++) {
    int sc = j < 4 ? p[j] & 63 : (p[j + 4] & 0x0f) | (p[j - 4] >> 6) << 4;
    int m = j < 4 ? p[j + 4] & 63 : (p[j + 4] >> 4) | (p[j] >> 6) << 4;
    s->sc16[2 * j] = s->sc16[2 * j + 1] = (short)sc;
    s->m16[2 * j] = s->m16[2 * j + 1] = (short)m;
  }
  s->d = f16_to_f32(blk);
  s->dmin = f16_to_f32(blk + 2);
#elif TV_QTYPE == 23
  unsigned short high;  /* bits 2s, 2s + 1: bits 4-5 of sub-block s's scale; its bits 0-3: nibble s of bytes 4-7 */
  __builtin_memcpy(&high, blk + 2, 2);
  for (int j = 0; j < 8; j++) {
    int sc = (blk[4 + j / 2] >> 4 * (j % 2) & 0x0f) | (high >> 2 * j & 3) << 4;
    s->sc16[2 * j] = s->sc16[2 * j + 1] = (short)(sc - 32);
    s->m16[2 * j] = s->m16[2 * j + 1] = 0;
  }
  s->d = f16_to_f32(blk);
  s->dmin = 0.0f;
#elif TV_AVX2
  _mm256_storeu_si256((__m256i*)s->sc16, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192))));
  _mm256_storeu_si256((__m256i*)s->m16, _mm256_setzero_si256());
  s->d = f16_to_f32(blk + 208);
  s->dmin = 0.0f;
#else
  for (int g = 0; g < 16; g++) {
    s->sc16[g] = (signed char)blk[192 + g];
    s->m16[g] = 0;
  }
  s->d = f16_to_f32(blk + 208);
  s->dmin = 0.0f;
#endif
}

/* weight k (0..255) of a super-block as its integer q (Q4_K: 0..15, Q5_K: 0..31, Q6_K: 0..63, IQ4_XS: one of the
 * 16 values) */
TV_INLINE int quant_at(const unsigned char* blk, int k) {
#if TV_QTYPE == 10 || TV_QTYPE == 11
  /* two halves of 128; element e of half h: bits 2 (e / 32) of byte e % 32 of the half's 32 bytes (as Q6_K's qh) */
  int h = k / 128, e = k % 128;
  int q = blk[(TV_QTYPE == 10 ? 16 : 32) + 32 * h + e % 32] >> 2 * (e / 32) & 3;
#if TV_QTYPE == 11
  q |= (blk[k % 32] >> (k / 32) & 1) << 2;  /* Q3_K's high bit: bit k / 32 of hmask[k % 32]; the -4 comes later */
#endif
  return q;
#elif TV_QTYPE == 23
  static const signed char values[16] = {IQ4NL_VALUES};
  unsigned char byte = blk[8 + 16 * (k / 32) + k % 16];  /* sub-block k / 32 packed as a Q4_0 block */
  return values[(k % 32) < 16 ? byte & 0x0f : byte >> 4];
#elif TV_QTYPE == 12
  int c = k / 64, l = k % 32;  /* chunk c of 32 bytes: sub-block 2c in the lo nibbles, 2c + 1 in the hi */
  unsigned char byte = blk[16 + 32 * c + l];
  return (k % 64) < 32 ? byte & 0x0f : byte >> 4;
#elif TV_QTYPE == 13
  int c = k / 64, l = k % 32;  /* as Q4_K (its nibbles from byte 48), and the fifth bit: bit k / 32 of qh[l] */
  unsigned char byte = blk[48 + 32 * c + l];
  return ((k % 64) < 32 ? byte & 0x0f : byte >> 4) | (blk[16 + l] >> (k / 32) & 1) << 4;
#else
  int h = k / 128, e = k % 128;
  int lo = e < 64 ? blk[64 * h + e] & 0x0f : blk[64 * h + e - 64] >> 4;
  int hi = (blk[128 + 32 * h + e % 32] >> (2 * (e / 32))) & 3;
  return lo | hi << 4;
#endif
}

#if TV_AVX2
/* acc + the int16 pairs of p, times their scales, added in pairs (VNNI: one instruction, the same sums) */
TV_INLINE __m256i scaled_add(__m256i acc, __m256i p, __m256i scale) {
#if TV_VNNI
  return _mm256_dpwssd_epi32(acc, p, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

/* 8 int32 lanes whose sum is  sum_s sc[s] * (sum_{k in s} q q_x)  over the whole super-block */
TV_INLINE __m256i superblock_dot(const unsigned char* restrict blk, const struct wscales* restrict s,
                                 const signed char* restrict xq) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  /* two chains: half the latency */
#if TV_QTYPE == 23
  const __m256i values = _mm256_setr_epi8(IQ4NL_VALUES, IQ4NL_VALUES);
  for (int j = 0; j < 8; j++) {  /* sub-block j: 16 bytes, lo nibbles its elements 0-15, hi nibbles 16-31 */
    __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + 8 + 16 * j)));
    __m256i q = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), low4);
    __m256i v = _mm256_shuffle_epi8(values, q);  /* signed, -127..113 */
    __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xq + 32 * j)), v);  /* x takes w's sign */
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), x);  /* |.| <= 2 * 127 * 127 < 2^15 */
    acc[j % 2] = scaled_add(acc[j % 2], p, _mm256_set1_epi16(s->sc16[2 * j]));
  }
#elif TV_QTYPE == 10 || TV_QTYPE == 11
  const __m256i low2 = _mm256_set1_epi8(0x03);
#if TV_QTYPE == 11
  const __m256i hmask = _mm256_loadu_si256((const __m256i*)blk);  /* bit 4h + k of byte l: element 32k + l of half h */
#endif
  for (int h = 0; h < 2; h++) {  /* two halves of 128 elements, 32 bytes of 2-bit quants each */
    __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + (TV_QTYPE == 10 ? 16 : 32) + 32 * h));
    for (int k = 0; k < 4; k++) {  /* elements 32k .. 32k + 31 of the half: sub-blocks 8h + 2k, 8h + 2k + 1 */
      __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * k), low2);
#if TV_QTYPE == 11  /* 0..7: the -4 comes later, from bsums */
      q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hmask, 4 * h + k),
                                                                _mm256_set1_epi8(1)), 2));
#endif
      __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(xq + 128 * h + 32 * k)));
      int g = 8 * h + 2 * k;  /* int16 lanes 0-7 are elements 0-15 (scale g), lanes 8-15 elements 16-31 (g + 1) */
      __m256i scale = _mm256_set_m128i(_mm_set1_epi16(s->sc16[g + 1]), _mm_set1_epi16(s->sc16[g]));
      acc[k % 2] = scaled_add(acc[k % 2], p, scale);
    }
  }
#elif TV_QTYPE == 12 || TV_QTYPE == 13
#if TV_QTYPE == 13
  const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));  /* bit s of byte l: element l of sub-block s */
  const __m256i one = _mm256_set1_epi8(1);
#endif
  for (int c = 0; c < 4; c++) {  /* 32 bytes of nibbles: sub-blocks 2c (lo) and 2c + 1 (hi) */
    __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + QS_AT + 32 * c));
    __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
#if TV_QTYPE == 13  /* the fifth bits, 0 or 16: bits 2c and 2c + 1 of each qh byte (16-bit shifts, then masked) */
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
#endif
    __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(xq + 64 * c)));
    __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xq + 64 * c + 32)));
    acc[0] = scaled_add(acc[0], plo, _mm256_set1_epi16(s->sc16[4 * c]));
    acc[1] = scaled_add(acc[1], phi, _mm256_set1_epi16(s->sc16[4 * c + 2]));
  }
#else
  const __m256i low2 = _mm256_set1_epi8(0x03);
  for (int h = 0; h < 2; h++) {  /* two halves of 128 elements */
    __m256i ql0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
    __m256i ql1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
    __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
    for (int k = 0; k < 4; k++) {  /* elements 32k .. 32k + 31 of the half: sub-blocks 8h + 2k, 8h + 2k + 1 */
      __m256i lo = k == 0 ? _mm256_and_si256(ql0, low4) : k == 1 ? _mm256_and_si256(ql1, low4)
                 : k == 2 ? _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4)
                          : _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), low2);
      __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  /* 0..63: the -32 comes later, from bsums */
      __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(xq + 128 * h + 32 * k)));
      int g = 8 * h + 2 * k;  /* int16 lanes 0-7 are elements 0-15 (scale g), lanes 8-15 elements 16-31 (g + 1) */
      __m256i scale = _mm256_set_m128i(_mm_set1_epi16(s->sc16[g + 1]), _mm_set1_epi16(s->sc16[g]));
      acc[k % 2] = scaled_add(acc[k % 2], p, scale);
    }
  }
#endif
  return _mm256_add_epi32(acc[0], acc[1]);
}

/* out[i, j] = dot(x[i, :], w[j, :]) for i < mr, j < nr (constants at every call site: unrolled) */
TV_INLINE void tile(float* restrict out, const struct xblock_k* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  __m256 acc[MR][NR];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
  for (int b = 0; b < NB; b++) {
    struct wscales s[NR];
    __m256i sc16[NR], m16[NR];
    for (int j = 0; j < nr; j++) {
      unpack_scales(&s[j], w + j * ROW_BYTES + b * BLOCK_BYTES);
#if TV_M == 1
      for (int l = 0; l < BLOCK_BYTES; l += 64) __builtin_prefetch(w + j * ROW_BYTES + b * BLOCK_BYTES + STREAM_PREFETCH + l, 0, 3);
#endif
      sc16[j] = _mm256_loadu_si256((const __m256i*)s[j].sc16);
      m16[j] = _mm256_loadu_si256((const __m256i*)s[j].m16);
    }
    for (int i = 0; i < mr; i++) {
      const struct xblock_k* xb = x + i * NB + b;
      __m256i bsums = _mm256_loadu_si256((const __m256i*)xb->bsums);
      for (int j = 0; j < nr; j++) {
        __m256i dot = superblock_dot(w + j * ROW_BYTES + b * BLOCK_BYTES, &s[j], xb->q);
#if HAS_MINS
        /* - dmin * sum_g m16[g] * bsums[g], its own float scale */
        __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, m16[j]));
        acc[i][j] = _mm256_fmadd_ps(mins, _mm256_set1_ps(-s[j].dmin * xb->d), acc[i][j]);
        (void)sc16;
#elif Q_OFFSET
        /* - Q_OFFSET * sum_g sc16[g] * bsums[g], in integers */
        dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16[j]), Q_OFFSET_SHIFT));
        (void)m16;
#else
        (void)bsums, (void)sc16, (void)m16;
#endif
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[j].d * xb->d), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) out[i * TV_N + j] = hsum8(acc[i][j]);
}

#else  /* portable C */

TV_INLINE void tile(float* restrict out, const struct xblock_k* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      float acc = 0.0f;
      for (int b = 0; b < NB; b++) {
        const unsigned char* blk = w + j * ROW_BYTES + b * BLOCK_BYTES;
        const struct xblock_k* xb = x + i * NB + b;
        struct wscales s;
        unpack_scales(&s, blk);
        int dot = 0, mins = 0;
        for (int g = 0; g < 16; g++) {  /* 16 weights share sc16[g] (and m16[g]) */
          int d16 = 0;
          for (int k = 16 * g; k < 16 * g + 16; k++) d16 += quant_at(blk, k) * xb->q[k];
          d16 -= Q_OFFSET * xb->bsums[g];
          dot += s.sc16[g] * d16;
          mins += s.m16[g] * xb->bsums[g];
        }
        acc += s.d * xb->d * (float)dot;
#if HAS_MINS
        acc -= s.dmin * xb->d * (float)mins;
#endif
      }
      out[i * TV_N + j] = acc;
    }
}
#endif

TV_TILE_COLUMN_FN(tile_column, tile, struct xblock_k, NB, unsigned char, ROW_BYTES)

/* One chunk: output columns [n0, n1) for every row of x. */
static void qmatmul_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  TV_CHUNK_COLUMNS(tile_column, chunk, a->out, a->xq, a->w);
}
