/* exp without libc (kernels are linked without it), as Cephes' expf, shared by paged_attention.c (exp8: 8 floats at
 * a time) and sampler.c (one float): x = n ln2 + r with n = round(x / ln2), |r| <= ln2/2, and exp(x) = 2^n exp(r).
 * exp8 clamps x to [-87.3, 88.3]; sampler.c rounds and scales its own way (exp(-inf) = 0). The 8-float types f8 and
 * i8 serve act_and_mul.c too, whose exp is llama.cpp's (see there). Needs TV_INLINE (threadpool.h) for exp8. */
#ifndef TV_EXP_POLY_H
#define TV_EXP_POLY_H

/* exp(r) for r = x - n ln2 (ln2 split in two for precision), by a degree-7 polynomial (relative error ~1e-7).
 * T is float or a vector of floats: the same operations in every lane. */
#define TV_EXP_REDUCED(T, x, n)                                                    \
  ({                                                                               \
    T r_ = (x) - (n) * 0.693359375f + (n) * 2.12194440e-4f;                        \
    T y_ = (T){0} + 1.9875691500e-4f;                                              \
    y_ = y_ * r_ + 1.3981999507e-3f;                                               \
    y_ = y_ * r_ + 8.3334519073e-3f;                                               \
    y_ = y_ * r_ + 4.1665795894e-2f;                                               \
    y_ = y_ * r_ + 1.6666665459e-1f;                                               \
    y_ = y_ * r_ + 5.0000001201e-1f;                                               \
    y_ * r_ * r_ + r_ + 1.0f;                                                      \
  })

/* 8 floats in one AVX2 register; aligned(4) makes loads through a pointer to it unaligned loads */
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int i8 __attribute__((vector_size(32), aligned(4)));

TV_INLINE f8 exp8(f8 x) {
  const f8 magic = (f8){0} + 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer, kept in the low bits */
  x = __builtin_elementwise_min(__builtin_elementwise_max(x, (f8){0} - 87.3f), (f8){0} + 88.3f);
  f8 t = x * 1.44269504f + magic;
  f8 n = t - magic;                                   /* round(x / ln2) */
  f8 y = TV_EXP_REDUCED(f8, x, n);                   /* exp(x - n*ln2) */
  i8 bits = ((i8)t - (i8)magic + 127) << 23;          /* 2^n as a float's bits */
  return y * (f8)bits;
}

#endif  /* TV_EXP_POLY_H */
