/* Helpers shared by the quantized matmuls (qmatmul.c, qmatmul_k.c): float16 scales, and x rounded to 8 bits.
 *
 * x is quantized the same way in both files, per block of 32 (qmatmul.c) or 256 (qmatmul_k.c) floats:
 *     d = max|x| / 127        q = rint(x * (127 / max|x|))   (round half to even; q in -127..127; all zero if x is)
 * tests/test_kernels_qlinear.py repeats these float32 operations in numpy and gets the same q and d.
 *
 * Everything is TV_INLINE (always inlined): a kernel's entry must stay the first function of its object.
 */
#ifndef TV_QDOT_H
#define TV_QDOT_H

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(TV_SCALAR)
#define TV_AVX2 1
#include <immintrin.h>
#else
#define TV_AVX2 0  /* portable C: the same numbers, one product at a time (TV_SCALAR forces it, for the tests) */
#endif

/* The little-endian float16 at p, as a float (exact: every float16 is a float). */
TV_INLINE float f16_to_f32(const unsigned char* p) {
  unsigned int h = p[0] | (unsigned int)p[1] << 8;
#if TV_AVX2
  return _cvtsh_ss((unsigned short)h);
#else
  unsigned int sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) return (sign ? -1.0f : 1.0f) * (float)man * 0x1p-24f;  /* zero or subnormal */
  union { unsigned int u; float f; } v;
  v.u = sign | (exp == 31 ? 0x7f800000u | man << 13 : (exp + 112) << 23 | man << 13);  /* inf/nan, or rebias */
  return v.f;
#endif
}

/* max |x[k]| for k < n (n a multiple of 32) */
TV_INLINE float max_abs(const float* x, int n) {
#if TV_AVX2
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
  float m = 0.0f;
  for (int k = 0; k < n; k++) m = __builtin_fabsf(x[k]) > m ? __builtin_fabsf(x[k]) : m;
  return m;
#endif
}

/* q[k] = rint(x[k] * id) for 32 floats; returns sum(q) */
TV_INLINE int quantize_32(signed char* restrict q, const float* restrict x, float id) {
#if TV_AVX2
  __m256i v[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; i++) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(id)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v[i] = _mm256_cvtps_epi32(r);
    sum = _mm256_add_epi32(sum, v[i]);
  }
  /* 4 x 8 int32 -> 32 int8: the packs interleave 128-bit lanes, the permute puts the 4-byte groups back in order */
  __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
#else
  int sum = 0;
  for (int k = 0; k < 32; k++) {
    q[k] = (signed char)__builtin_rintf(x[k] * id);
    sum += q[k];
  }
  return sum;
#endif
}

#if TV_AVX2
TV_INLINE float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

/* ---- many rows of x (M >= TV_FLOAT_MIN_M): dequantize a few rows of w once, then float32 FMAs ----
 *
 * Per block and pair (row of x, row of w) the integer route costs a maddubs, a madd, a conversion, a scale and an
 * FMA: more than the 4 float32 FMAs that do the same 32 products (measured on one core: ~75 GFLOP/s against
 * matmul.c's ~100 once M >= 8, weights in cache). Its advantage is touching each weight once per row of x; with
 * many rows it is the arithmetic that counts. So from TV_FLOAT_MIN_M rows on, the kernel dequantizes FNR rows of
 * w into a float buffer (L1) and runs matmul.c's 4x3 register tile over the rows of x, in float32 (x not rounded:
 * these rows get the float product of the dequantized weights). The weights still come from memory as blocks,
 * 4.5-8.5 bits per weight, and each dequantized tile serves up to FMB rows of x. Measured on one core, Q4_1
 * 960x576 in cache: M=8 integer 76 GFLOP/s, float path 66; M=12: 76 against 85; M=32: 73 against 97 (matmul.c
 * float32: 102); M=128: float path 102, matmul.c 98. Hence the switch at 12 rows.
 * Each kernel file provides dequantize_row (one row of w as K floats). The kernel's first pass (x to 8 bits)
 * is skipped on this path. */
#define TV_FLOAT_MIN_M 12  /* qlinear.FLOAT_PATH_MIN_M says the same (a test checks) */
#define FMR 4
#define FNR 3
#define FMB 64              /* rows of x per dequantized tile */

/* 8 floats; aligned(4): loads through it are unaligned loads (as matmul.c's f8) */
typedef float tv_f8 __attribute__((vector_size(32), aligned(4)));

TV_INLINE void dequantize_row(float* restrict dst, const unsigned char* restrict row);

/* dst[k] = scale[k / sub] * q[k] + offset[k / sub] for k < n: integers of a block to floats (n, sub: multiples of 8) */
TV_INLINE void affine_to_float(float* restrict dst, const signed char* restrict q, int n, int sub,
                               const float* restrict scale, const float* restrict offset) {
#if TV_AVX2
  for (int k = 0; k < n; k += 8) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + k))));
    _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(v, _mm256_set1_ps(scale[k / sub]), _mm256_set1_ps(offset[k / sub])));
  }
#else
  for (int k = 0; k < n; k++) dst[k] = scale[k / sub] * (float)q[k] + offset[k / sub];
#endif
}

TV_INLINE float hsum_f8(tv_f8 v) {
  typedef float f4 __attribute__((vector_size(16)));
  f4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  a = a + __builtin_shufflevector(a, a, 2, 3, 0, 1);
  a = a + __builtin_shufflevector(a, a, 1, 0, 3, 2);
  return a[0];
}

/* out[i, j] = dot(x[i, :], wt[j, :]) for i < mr, j < nr (constants at each call site: unrolled, in registers) */
TV_INLINE void float_tile(float* restrict out, const float* restrict x, const float* restrict wt, int mr, int nr) {
  tv_f8 acc[FMR][FNR];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = (tv_f8){0};
  for (int k = 0; k < TV_K; k += 8) {
    tv_f8 wv[FNR];
    for (int j = 0; j < nr; j++) wv[j] = *(const tv_f8*)(wt + j * TV_K + k);
    for (int i = 0; i < mr; i++) {
      tv_f8 xv = *(const tv_f8*)(x + i * TV_K + k);
      for (int j = 0; j < nr; j++) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) out[i * TV_N + j] = hsum_f8(acc[i][j]);
}

/* rows m0..m1 of x against the nr dequantized rows in wt (out: column n) */
TV_INLINE void float_tile_column(float* restrict out, const float* restrict x, const float* restrict wt,
                                 int m0, int m1, int nr) {
  int m = m0;
  for (; m + FMR <= m1; m += FMR) float_tile(out + m * TV_N, x + m * TV_K, wt, FMR, nr);
  switch (m1 - m) {  /* a constant mr per case, so each case is its own unrolled tile */
    case 3: float_tile(out + m * TV_N, x + m * TV_K, wt, 3, nr); break;
    case 2: float_tile(out + m * TV_N, x + m * TV_K, wt, 2, nr); break;
    case 1: float_tile(out + m * TV_N, x + m * TV_K, wt, 1, nr); break;
    default: break;
  }
}

/* output columns [n0, n1) for every row of x: w's rows n0..n1 (row_bytes each) dequantized FNR at a time */
TV_INLINE void float_chunk(float* restrict out, const float* restrict x, const unsigned char* restrict w,
                           int row_bytes, int n0, int n1) {
  float wt[FNR * TV_K];  /* FNR rows of w as floats: 3 x 1536 x 4 B = 18 KB for the model's widest K */
  for (int m0 = 0; m0 < TV_M; m0 += FMB) {
    int m1 = m0 + FMB < TV_M ? m0 + FMB : TV_M;
    for (int n = n0; n < n1; n += FNR) {
      int nr = n1 - n < FNR ? n1 - n : FNR;
      for (int j = 0; j < nr; j++) dequantize_row(wt + j * TV_K, w + (long)(n + j) * row_bytes);
      switch (nr) {
        case 3: float_tile_column(out + n, x, wt, m0, m1, 3); break;
        case 2: float_tile_column(out + n, x, wt, m0, m1, 2); break;
        default: float_tile_column(out + n, x, wt, m0, m1, 1); break;
      }
    }
  }
}

#endif
