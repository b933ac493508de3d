/* Helpers shared by the quantized GEMV kernels qmatmul.metal and qmatmul_k.metal: float16 scales, and packed bytes
 * of weights dotted with 4 floats of x. The twin of kernels/cuda/qdot.cuh (the warp's sum is Metal's simd_sum). */
#ifndef TV_QDOT_H
#define TV_QDOT_H

inline float sum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }

/* the 4 bytes of q, each an unsigned value minus `offset`, dotted with v.x .. v.w */
inline float ubytes_dot(uint q, int offset, float4 v) {
  float s = float(int(q & 0xFF) - offset) * v.x;
  s = fma(float(int(q >> 8 & 0xFF) - offset), v.y, s);
  s = fma(float(int(q >> 16 & 0xFF) - offset), v.z, s);
  return fma(float(int(q >> 24) - offset), v.w, s);
}

/* the 4 bytes of q, each an int8 (shifted to the top, then arithmetic-shifted back: sign-extended), dotted with v */
inline float sbytes_dot(uint q, float4 v) {
  float s = float(int(q << 24) >> 24) * v.x;
  s = fma(float(int(q << 16) >> 24), v.y, s);
  s = fma(float(int(q << 8) >> 24), v.z, s);
  return fma(float(int(q) >> 24), v.w, s);
}

/* 4 bytes from a 2-byte aligned address: two ushort loads */
inline uint load_u32_2(const device uchar* p) {
  const device ushort* h = (const device ushort*)p;
  return h[0] | uint(h[1]) << 16;
}

inline float f16(const device uchar* p) { return float(*(const device half*)p); }

/* IQ4_NL's (and IQ4_XS's) 16 int8 values (ggml's kvalues_iq4nl), indexed by a nibble */
constant char IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* 4 bytes of indices (each 0..15) -> their 4 values as signed bytes (CUDA's twin permutes bytes: Metal looks up) */
inline uint iq4nl_bytes(uint q) {
  return uint(uchar(IQ4NL_VALUES[q & 15])) | uint(uchar(IQ4NL_VALUES[q >> 8 & 15])) << 8 |
         uint(uchar(IQ4NL_VALUES[q >> 16 & 15])) << 16 | uint(uchar(IQ4NL_VALUES[q >> 24 & 15])) << 24;
}

#endif  /* TV_QDOT_H */
