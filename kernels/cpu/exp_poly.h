/* exp without libc (kernels are linked without it), as Cephes' expf, shared by paged_attention.c (8 floats at a
 * time) and sampler.c (one float): x = n ln2 + r with n = round(x / ln2), |r| <= ln2/2, and exp(x) = 2^n exp(r).
 * Each file rounds x / ln2 and puts 2^n into the exponent bits its own way (clamped, or with exp(-inf) = 0). */
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

#endif  /* TV_EXP_POLY_H */
