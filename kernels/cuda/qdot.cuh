/* Device helpers shared by the quantized GEMV kernels qmatmul.cu and qmatmul_k.cu: the warp's sum, float16 scales,
 * and packed bytes of weights dotted with 4 floats of x (the including file defines WARP). The twin of
 * kernels/metal/qdot.h. */
#ifndef TV_QDOT_CUH
#define TV_QDOT_CUH

__device__ __forceinline__ float warp_sum(float x) {  /* on every lane (xor butterfly: 5 shuffles) */
  for (int offset = WARP / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float sum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }

/* the 4 bytes of q, each an unsigned value minus `offset`, dotted with v.x .. v.w */
__device__ __forceinline__ float ubytes_dot(unsigned q, int offset, float4 v) {
  float s = (float)((int)(q & 0xFF) - offset) * v.x;
  s = fmaf((float)((int)(q >> 8 & 0xFF) - offset), v.y, s);
  s = fmaf((float)((int)(q >> 16 & 0xFF) - offset), v.z, s);
  return fmaf((float)((int)(q >> 24) - offset), v.w, s);
}

/* the 4 bytes of q, each an int8 (shifted to the top, then arithmetic-shifted back: sign-extended), dotted with v */
__device__ __forceinline__ float sbytes_dot(unsigned q, float4 v) {
  float s = (float)((int)(q << 24) >> 24) * v.x;
  s = fmaf((float)((int)(q << 16) >> 24), v.y, s);
  s = fmaf((float)((int)(q << 8) >> 24), v.z, s);
  return fmaf((float)((int)q >> 24), v.w, s);
}

/* 4 bytes from a 2-byte aligned address: two unsigned short loads */
__device__ __forceinline__ unsigned load_u32_2(const unsigned char* p) {
  const unsigned short* h = (const unsigned short*)p;
  return h[0] | (unsigned)h[1] << 16;
}

__device__ __forceinline__ float f16(const unsigned char* p) { return __half2float(*(const __half*)p); }

/* IQ4_NL's (and IQ4_XS's) 16 int8 values (ggml's kvalues_iq4nl: -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89
 * 113), 4 per word, value 4i + b in byte b of word i */
#define IQ4NL_WORD0 0xBFAD9881u
#define IQ4NL_WORD1 0xF6EADDCFu
#define IQ4NL_WORD2 0x26190D01u
#define IQ4NL_WORD3 0x71594535u

/* 4 bytes of indices (each 0..15) -> their 4 values as signed bytes: two byte permutes pick each index's value from
 * the table's low and high halves by its low 3 bits, its bit 3 chooses between the two */
__device__ __forceinline__ unsigned iq4nl_bytes(unsigned q) {
  const unsigned sel = (q & 0x07u) | (q >> 4 & 0x70u) | (q >> 8 & 0x700u) | (q >> 12 & 0x7000u);
  const unsigned lo = __byte_perm(IQ4NL_WORD0, IQ4NL_WORD1, sel), hi = __byte_perm(IQ4NL_WORD2, IQ4NL_WORD3, sel);
  const unsigned high = (q >> 3 & 0x01010101u) * 0xFFu;  /* 0xFF in the bytes whose index is 8..15 */
  return (lo & ~high) | (hi & high);
}

#endif  /* TV_QDOT_CUH */
