/* Helpers shared by the quantized matmuls (qmatmul.c, qmatmul_k.c and the repacked layouts' qmatmul_x8.c and
 * qmatmul_k_x8.c): float16 scales, and x rounded to 8 bits.
 *
 * x is quantized the same way in both files, per block of 32 (qmatmul.c) or 256 (qmatmul_k.c) floats:
 *     d = max|x| / 127        q = rint(x * (127 / max|x|))   (round half to even; q in -127..127; all zero if x is)
 * tests/kernels/test_qlinear.py repeats these float32 operations in numpy and gets the same q and d.
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

/* AVX-512 VNNI (with VL: its 256-bit forms): _mm256_dpbusd_epi32 does maddubs + madd (u8 x i8, groups of 4 added
 * into int32) in one instruction and without the int16 step. The kernels are compiled on the machine that runs them
 * (clang -march=native, tinyvllm/kernels/launcher.py), so the compiler's __AVX512VNNI__ is this CPU's cpuid bit: the
 * choice is made per machine when the kernel is built. The integer sums are exact either way (maddubs' int16 pairs
 * stay below 2^15, see qmatmul.c), so both routes give the same bits; TV_NO_VNNI forces AVX2's, for the tests. */
#if TV_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(TV_NO_VNNI)
#define TV_VNNI 1
#else
#define TV_VNNI 0
#endif
/* ... and with AVX-512F/BW as well, qmatmul.c takes two blocks per 512-bit register (its "pairs", see there) */
#if TV_VNNI && defined(__AVX512F__) && defined(__AVX512BW__)
#define TV_AVX512 1
#else
#define TV_AVX512 0
#endif

/* IQ4_NL's (and IQ4_XS's) 16 values, indexed by a nibble: a non-linear grid, denser near zero where most weights
 * are (ggml's kvalues_iq4nl). Written out where a table is needed: a static array, or the 16 bytes of a shuffle. */
#define IQ4NL_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113

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

/* 256 elements of x, quantized for the super-block formats (qmatmul_k.c, qmatmul_k_x8.c): x ~= d * q.
 * llama.cpp's block_q8_K, with a symmetric 127 scale */
struct xblock_k {
  float d;              /* max|x| / 127 */
  short bsums[16];      /* bsums[g] = sum of q[16g .. 16g + 15] */
  signed char q[256];
};
_Static_assert(sizeof(struct xblock_k) == 292, "qlinear.X_BLOCK_BYTES['qmatmul_k'] says 292");

TV_INLINE void quantize_block_k(struct xblock_k* restrict out, const float* restrict x) {
  float max = max_abs(x, 256), id = max != 0.0f ? 127.0f / max : 0.0f;
  for (int g = 0; g < 8; g++) quantize_32(out->q + 32 * g, x + 32 * g, id);
  for (int g = 0; g < 16; g++) {
    int s = 0;
    for (int k = 0; k < 16; k++) s += out->q[16 * g + k];
    out->bsums[g] = (short)s;
  }
  out->d = max / 127.0f;
}

#if TV_AVX2
TV_INLINE float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

#if TV_AVX2
/* The repacked layouts' two steps (qmatmul_x8.c, qmatmul_k_x8.c), where lane r of a vector is row r of w:
 * acc + in each int32 lane the 4 products of its u8 and i8 bytes (VNNI: one instruction, the same sums) */
TV_INLINE __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
#if TV_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* ... and the 4 bytes of x at p, in every int32 lane (each row's lane multiplies the same 4 of x) */
TV_INLINE __m256i broadcast4(const signed char* p) {
  int v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
#endif

#endif
