/* out = x @ dequantize(w).T with w kept in its GGUF blocks: the fused dequantize-matmul for the 256-element
 * super-block formats Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, in CUDA. The twin of
 * kernels/cpu/qmatmul_k.c and kernels/metal/qmatmul_k.metal
 * (same arguments in the same order, launched by tinyvllm/kernels/qlinear.py); the 32-element formats are in
 * qmatmul.cu. Compiled by tinygrad's CUDA compiler (nvrtc) from this text.
 *
 * Why: a decode step reads every weight once and does 2 flops with it, so its time is the weights' bytes over the
 * memory bandwidth. Per weight, float32 is 4 B, Q4_K 144/256 = 0.5625 B (4.5 bits), Q6_K 210/256 = 0.82 B
 * (6.56 bits): a Q4_K_M file (Q4_K linears, Q6_K for a few) is read 6-7x faster than its float32 copy, if the
 * super-blocks are dequantized in registers on the way to the FMAs and never written back as floats.
 *
 * How the GEMV route's work is cut (local_size (128, 1, 1): 4 warps; grid ((N + 3) / 4, M, 1)):
 *
 *     thread block (bx, m):   warp 0 -> out[m, 4 bx]   warp 1 -> out[m, 4 bx + 1]   ...   warp 3 -> out[m, 4 bx + 3]
 *     one warp, one output:   w's row n is K / 256 super-blocks = K / 32 sub-blocks of 32 weights ("units");
 *                             lane j takes units j, j + 32, j + 64, ... (unit u: super-block u / 8, part u % 8)
 *     one lane, one unit:     its scale (and min) from the super-block's packed scales, 32 weights dequantized in
 *                             registers, 32 float FMAs with x[m, 32 u .. 32 u + 31]
 *     the warp's 32 sums:     a butterfly of 5 shuffles; lane 0 writes out[m, n]
 *
 * Why units of 32 and not whole super-blocks per lane: a row of K = 1536 (SmolLM2's FFN) is only 6 super-blocks,
 * which would leave 26 of the 32 lanes idle; it is 48 units. The 8 lanes of one super-block read its header
 * (d, dmin, scales) each: the same bytes, served from cache.
 *
 * Vectorised loads: x as float4 (its rows are K * 4 bytes, a multiple of 1024, and tinygrad's buffers are at least
 * 16-byte aligned, so every unit's 32 floats start 16-byte aligned). Q4_K's super-blocks are 144 = 9 x 16 bytes and
 * its quants start at byte 16, so a unit's 32 bytes of quants are read as 2 x uint4; its 12 bytes of packed scales
 * are read byte by byte (2 of the 12 are needed). Q6_K's are 210 bytes: only 2-byte alignment survives from one
 * super-block to the next, so its quants are read as unsigned shorts, two joined per 32-bit word.
 *
 * Two routes, chosen by the rows of x (tinyvllm/kernels/qlinear.py, gpu_launches), as llama.cpp's MMVQ and MMQ:
 *   M <= 8, this file's `qmatmul_k` (at its end): each lane dequantizes the weights and multiplies in float; x is
 *          read as it is and the scratch argument is unused (the CPU twin quantizes x into it);
 *   M > 8,  `quantize_x` then `qmatmul_tiled` (qmatmul_tiled.cuh, its header draws them): x quantized to 8-bit blocks
 *          in the scratch, 64 x 64 output tiles from shared memory, integer dot products. TV_QUANTIZE_X or
 *          TV_QMATMUL_TILED selects that entry; this file gives it `load_unit`, its blocks as 8-bit words.
 *
 * Arguments (row-major):
 *   out:     (M, N)                        float32, written
 *   scratch: (gpu_scratch_bytes(M, K),)    uint8: the tiled route's x in 8-bit blocks; unused by the GEMV
 *   x:       (M, K)                        float32, the activations
 *   w:       (N, K / 256 * TYPE_SIZE)      uint8, row n = the GGUF's super-blocks of output feature n, as in the file:
 *     Q4_K (TV_QTYPE 12), 144 B:  d (f16) | dmin (f16) | scales[12] | qs[128]
 *         8 sub-blocks of 32, each with a 6-bit scale sc and min mn packed in scales[12];
 *         qs: 4 chunks of 32 bytes, chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high nibbles;
 *         x = d * sc * q - dmin * mn, q in 0..15
 *     Q5_K (TV_QTYPE 13), 176 B:  d (f16) | dmin (f16) | scales[12] | qh[32] | qs[128]
 *         Q4_K's scales and nibbles, and a fifth bit: bit s of qh[l] for weight l of sub-block s; q in 0..31
 *     Q2_K (TV_QTYPE 10), 84 B:   scales[16] | qs[64] | d (f16) | dmin (f16)
 *         16 sub-blocks of 16, byte g of scales: sub-block g's scale (lo nibble) and min (hi nibble); two halves of
 *         128 weights, weight e of half h = bits 2 (e / 32) of qs[32h + e % 32]; x = d * sc * q - dmin * m, q 0..3
 *     Q3_K (TV_QTYPE 11), 110 B:  hmask[32] | qs[64] | scales[12] | d (f16)
 *         16 sub-blocks of 16, 6-bit scales (quant.py's _q3_k_scales); the 2 low bits as Q2_K's, the high bit of
 *         weight 32j + l in bit j of hmask[l]; x = d * (sc - 32) * (q - 4), q in 0..7
 *     IQ4_XS (TV_QTYPE 23), 136 B: d (f16) | scales_h (u16) | scales_l[4] | qs[128]
 *         8 sub-blocks of 32, each with a 6-bit scale sc (bits 0-3 in scales_l's nibble s, bits 4-5 in scales_h's bits
 *         2s, 2s + 1); sub-block s's 16 bytes of nibbles as Q4_0 packs a block; x = d * (sc - 32) * values[q]
 *     Q6_K (TV_QTYPE 14), 210 B:  ql[128] | qh[64] | scales[16] int8 | d (f16)
 *         16 sub-blocks of 16, each with an int8 scale; two halves of 128 weights, half h uses ql[64h .. 64h + 63]
 *         and qh[32h .. 32h + 31]; weight e of a half: low 4 bits from ql[e % 64] (low nibble if e < 64, else
 *         high), high 2 bits = bits 2 (e / 32) .. 2 (e / 32) + 1 of qh[e % 32]; x = d * scale * (q - 32), q in 0..63
 *     (byte layouts drawn in tinyvllm/model/quant.py)
 * Compile-time constants: TV_M, TV_N, TV_K (a multiple of 256), TV_QTYPE (ggml's type id);
 * TV_KERNEL (extern "C" __global__ void).
 */
#include <cuda_fp16.h>

#define WARP 32
#define OUTS_PER_BLOCK 4  /* warps per thread block, one output each */
#define QK_K 256          /* elements per super-block */
#define UNIT 32           /* elements per unit of a lane's work: a sub-block of Q4_K, two of Q6_K */

#if TV_QTYPE == 10
#define TYPE_SIZE 84
#elif TV_QTYPE == 11
#define TYPE_SIZE 110
#elif TV_QTYPE == 12
#define TYPE_SIZE 144
#elif TV_QTYPE == 13
#define TYPE_SIZE 176
#elif TV_QTYPE == 14
#define TYPE_SIZE 210
#elif TV_QTYPE == 23
#define TYPE_SIZE 136
#else
#error "qmatmul_k.cu takes TV_QTYPE 10 (Q2_K), 11 (Q3_K), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K), 23 (IQ4_XS)"
#endif
#if TV_K % QK_K != 0
#error "qmatmul_k.cu: TV_K must be a multiple of 256 (a row is whole super-blocks)"
#endif
#define ROW_BYTES (TV_K / QK_K * TYPE_SIZE)

#include "qdot.cuh"

#if TV_QTYPE == 12 || TV_QTYPE == 13
#define QS_AT (TV_QTYPE == 13 ? 48 : 16)  /* where the nibbles start (Q5_K: after its 32 bytes of fifth bits) */
/* Q4_K, Q5_K: the 6-bit scale and min of sub-block s (0..7) from the super-block's 12 packed bytes (quant.py's
 * _k_scales_mins draws the bit layout) */
__device__ __forceinline__ void q4k_scale_min(const unsigned char* packed, int s, int* sc, int* mn) {
  if (s < 4) {
    *sc = packed[s] & 63;
    *mn = packed[s + 4] & 63;
  } else {
    *sc = (packed[s + 4] & 0xF) | (packed[s - 4] >> 6) << 4;
    *mn = (packed[s + 4] >> 4) | (packed[s] >> 6) << 4;
  }
}

/* Q4_K, Q5_K: sub-block s (0..7) of the super-block at blk, dotted with its 32 floats of x (xu: 8 float4):
 * d * sc * sum q x - dmin * mn * sum x */
__device__ __forceinline__ float unit_dot(const unsigned char* blk, int s, const float4* xu) {
  const unsigned char* packed = blk + 4;  /* scales[12]: see quant.py's _k_scales_mins for the bit layout */
  int sc, mn;
  q4k_scale_min(packed, s, &sc, &mn);
  const uint4* chunk = (const uint4*)(blk + QS_AT + 32 * (s / 2));  /* 32 bytes; ours are the nibbles at `shift` */
  const int shift = 4 * (s % 2);
  float qx = 0.0f, sx = 0.0f;
  for (int h = 0; h < 2; h++) {
    const uint4 v = chunk[h];
    const unsigned words[4] = {v.x, v.y, v.z, v.w};  /* word i: weights 16h + 4i .. 16h + 4i + 3 */
#if TV_QTYPE == 13
    const uint4 b5 = ((const uint4*)(blk + 16))[h];  /* Q5_K: bit s of byte l is weight l's fifth bit */
    const unsigned fifth[4] = {b5.x >> s & 0x01010101u, b5.y >> s & 0x01010101u, b5.z >> s & 0x01010101u,
                               b5.w >> s & 0x01010101u};
#else
    const unsigned fifth[4] = {0u, 0u, 0u, 0u};
#endif
    for (int i = 0; i < 4; i++) {
      qx += ubytes_dot((words[i] >> shift & 0x0F0F0F0Fu) | fifth[i] << 4, 0, xu[4 * h + i]);
      sx += sum4(xu[4 * h + i]);
    }
  }
  return fmaf(f16(blk) * (float)sc, qx, -(f16(blk + 2) * (float)mn) * sx);
}
#elif TV_QTYPE == 10 || TV_QTYPE == 11
#if TV_QTYPE == 11
/* Q3_K: the scale of sub-block g (0..15), sc - 32: bits 0-3 in nibble g / 8 of byte 96 + g % 8, bits 4-5 at bits
 * 2 (g / 4) of byte 104 + g % 4 (quant.py's _q3_k_scales) */
__device__ __forceinline__ int q3k_scale(const unsigned char* blk, int g) {
  return (int)((blk[96 + g % 8] >> 4 * (g / 8) & 0xFu) | (blk[104 + g % 4] >> 2 * (g / 4) & 3u) << 4) - 32;
}
#endif

/* Q2_K, Q3_K: part p (0..7: weights 32p .. 32p + 31) of the super-block at blk, dotted with its 32 floats of x (xu),
 * as Q6_K's parts: half h = p / 4 of 128 weights, weights 32k .. 32k + 31 of it (k = p % 4) are bits 2k, 2k + 1 of
 * the half's 32 bytes of 2-bit quants; two sub-blocks of 16, each its own scale (Q2_K: and min).
 *   Q2_K: d * (sc_a sum q x + sc_b ...) - dmin * (m_a sum x + m_b ...), q in 0..3
 *   Q3_K: d * ((sc_a - 32) sum (q - 4) x + ...), q = 2 bits | hmask bit << 2, hmask bit 4h + k of byte l */
__device__ __forceinline__ float unit_dot(const unsigned char* blk, int p, const float4* xu) {
  const int h = p / 4, k = p % 4, g = 2 * p;
  const unsigned char* qs = blk + (TV_QTYPE == 10 ? 16 : 32) + 32 * h;
  float s[2] = {0.0f, 0.0f}, sx[2] = {0.0f, 0.0f};
  for (int i = 0; i < 8; i++) {  /* word i: weights 4i .. 4i + 3 of the part */
    unsigned q = load_u32_2(qs + 4 * i) >> 2 * k & 0x03030303u;
#if TV_QTYPE == 10
    s[i / 4] += ubytes_dot(q, 0, xu[i]);
    sx[i / 4] += sum4(xu[i]);
#else
    q |= (load_u32_2(blk + 4 * i) >> (4 * h + k) & 0x01010101u) << 2;
    s[i / 4] += ubytes_dot(q, 4, xu[i]);
#endif
  }
#if TV_QTYPE == 10
  const float d = f16(blk + 80), dmin = f16(blk + 82);
  const float dot = fmaf((float)(blk[g] & 0xF), s[0], (float)(blk[g + 1] & 0xF) * s[1]);
  return fmaf(d, dot, -dmin * fmaf((float)(blk[g] >> 4), sx[0], (float)(blk[g + 1] >> 4) * sx[1]));
#else
  (void)sx;
  return f16(blk + 108) * fmaf((float)q3k_scale(blk, g), s[0], (float)q3k_scale(blk, g + 1) * s[1]);
#endif
}
#elif TV_QTYPE == 23
/* IQ4_XS: the scale of sub-block s (0..7), sc - 32: bits 0-3 are nibble s of bytes 4-7, bits 4-5 bits 2s, 2s + 1 of
 * the u16 at byte 2 (quant.py's dequantize_iq4_xs draws it) */
__device__ __forceinline__ int iq4xs_scale(const unsigned char* blk, int s) {
  const unsigned high = *(const unsigned short*)(blk + 2);
  return (int)((blk[4 + s / 2] >> 4 * (s % 2) & 0xFu) | (high >> 2 * s & 3u) << 4) - 32;
}

/* IQ4_XS: sub-block s (0..7) of the super-block at blk, dotted with its 32 floats of x (xu): d * (sc - 32) *
 * sum values[q] x; its 16 bytes of nibbles (at 8 + 16 s: 4-byte aligned, the super-blocks being 136 = 8 x 17 bytes)
 * pack it as Q4_0 packs a block */
__device__ __forceinline__ float unit_dot(const unsigned char* blk, int s, const float4* xu) {
  const unsigned* qs = (const unsigned*)(blk + 8 + 16 * s);
  float sum = 0.0f;
  for (int i = 0; i < 4; i++)
    sum += sbytes_dot(iq4nl_bytes(qs[i] & 0x0F0F0F0Fu), xu[i]) +
           sbytes_dot(iq4nl_bytes(qs[i] >> 4 & 0x0F0F0F0Fu), xu[4 + i]);
  return f16(blk) * (float)iq4xs_scale(blk, s) * sum;
}
#else
/* Q6_K: part p (0..7: weights 32p .. 32p + 31) of the super-block at blk, dotted with its 32 floats of x (xu):
 * d * (scale_a * sum (q - 32) x over its first 16 + scale_b * the same over its last 16) */
__device__ __forceinline__ float unit_dot(const unsigned char* blk, int p, const float4* xu) {
  const int h = p / 4, k = p % 4;                                /* half h, weights 32k .. 32k + 31 of it */
  const unsigned char* ql = blk + 64 * h + 32 * (k % 2);         /* low 4 bits: nibble k / 2 of these 32 bytes */
  const unsigned char* qh = blk + 128 + 32 * h;                  /* high 2 bits: bits 2k, 2k + 1 of these 32 */
  const signed char* scales = (const signed char*)(blk + 192 + 8 * h + 2 * k);  /* one per 16 weights */
  float s[2] = {0.0f, 0.0f};
  for (int i = 0; i < 8; i++) {  /* word i: weights 4i .. 4i + 3 of the part */
    const unsigned lo = load_u32_2(ql + 4 * i) >> 4 * (k / 2) & 0x0F0F0F0Fu;
    const unsigned hi = load_u32_2(qh + 4 * i) >> 2 * k & 0x03030303u;
    s[i / 4] += ubytes_dot(lo | hi << 4, 32, xu[i]);
  }
  return f16(blk + 208) * fmaf((float)scales[0], s[0], (float)scales[1] * s[1]);
}
#endif

#if defined(TV_QUANTIZE_X) || defined(TV_QMATMUL_TILED)
/* ---- the tiled route (M > 8): qmatmul_tiled.cuh, on this file's units of 32 ---- */

/* unit u of a row of w as 8 words of 4 signed bytes q (word i: elements 4i .. 4i + 3 of the unit), and its scales:
 * w = d_lo * q + c for elements 0-15, d_hi * q + c for 16-31 */
#if TV_QTYPE == 10
#define TWO_MINS 1  /* Q2_K: a min per 16 weights, so a constant term for each half of a unit (c, c_hi) */
__device__ __forceinline__ void load_unit(const unsigned char* w_row, int u, unsigned* q, float* d_lo, float* d_hi,
                                          float* c, float* c_hi) {
#else
__device__ __forceinline__ void load_unit(const unsigned char* w_row, int u, unsigned* q, float* d_lo, float* d_hi,
                                          float* c) {
#endif
  const unsigned char* blk = w_row + u / 8 * TYPE_SIZE;
#if TV_QTYPE == 12 || TV_QTYPE == 13  /* Q4_K, Q5_K: sub-block s: q = nibble (Q5_K: | bit), d = d sc, c = -dmin mn */
#define TWO_SCALES 0
  const int s = u % 8;
  const unsigned char* packed = blk + 4;
  int sc, mn;
  q4k_scale_min(packed, s, &sc, &mn);
  const uint4* chunk = (const uint4*)(blk + QS_AT + 32 * (s / 2));
  const int shift = 4 * (s % 2);
  for (int h = 0; h < 2; h++) {
    const uint4 v = chunk[h];
    q[4 * h] = v.x >> shift & 0x0F0F0F0Fu;
    q[4 * h + 1] = v.y >> shift & 0x0F0F0F0Fu;
    q[4 * h + 2] = v.z >> shift & 0x0F0F0F0Fu;
    q[4 * h + 3] = v.w >> shift & 0x0F0F0F0Fu;
#if TV_QTYPE == 13
    const uint4 b5 = ((const uint4*)(blk + 16))[h];
    q[4 * h] |= (b5.x >> s & 0x01010101u) << 4;
    q[4 * h + 1] |= (b5.y >> s & 0x01010101u) << 4;
    q[4 * h + 2] |= (b5.z >> s & 0x01010101u) << 4;
    q[4 * h + 3] |= (b5.w >> s & 0x01010101u) << 4;
#endif
  }
  *d_lo = *d_hi = f16(blk) * (float)sc;
  *c = -(f16(blk + 2) * (float)mn);
#elif TV_QTYPE == 10 || TV_QTYPE == 11  /* part p: two sub-blocks of 16, a scale (Q2_K: and a min) each */
#define TWO_SCALES 1
  const int p = u % 8, h = p / 4, k = p % 4, g = 2 * p;
  const unsigned char* qs = blk + (TV_QTYPE == 10 ? 16 : 32) + 32 * h;
  for (int i = 0; i < 8; i++) {
    const unsigned v = load_u32_2(qs + 4 * i) >> 2 * k & 0x03030303u;
#if TV_QTYPE == 10
    q[i] = v;  /* 0..3 */
#else  /* q - 4 as signed bytes, as Q6_K's q - 32 (load_unit below) */
    const unsigned hbit = load_u32_2(blk + 4 * i) >> (4 * h + k) & 0x01010101u;
    q[i] = (((v | hbit << 2) | 0x80808080u) - 0x04040404u) ^ 0x80808080u;
#endif
  }
#if TV_QTYPE == 10
  const float d = f16(blk + 80), dmin = f16(blk + 82);
  *d_lo = d * (float)(blk[g] & 0xF);
  *d_hi = d * (float)(blk[g + 1] & 0xF);
  *c = -dmin * (float)(blk[g] >> 4);
  *c_hi = -dmin * (float)(blk[g + 1] >> 4);
#else
  const float d = f16(blk + 108);
  *d_lo = d * (float)q3k_scale(blk, g);
  *d_hi = d * (float)q3k_scale(blk, g + 1);
  *c = 0.0f;
#endif
#elif TV_QTYPE == 23  /* IQ4_XS: sub-block s: q = values[nibble] (signed bytes), d = d * (sc - 32), c = 0 */
#define TWO_SCALES 0
  const int s = u % 8;
  const unsigned* qs = (const unsigned*)(blk + 8 + 16 * s);
  for (int i = 0; i < 4; i++) {
    q[i] = iq4nl_bytes(qs[i] & 0x0F0F0F0Fu);
    q[4 + i] = iq4nl_bytes(qs[i] >> 4 & 0x0F0F0F0Fu);
  }
  *d_lo = *d_hi = f16(blk) * (float)iq4xs_scale(blk, s);
  *c = 0.0f;
#else  /* Q6_K: part p: q = q6 - 32 (a signed byte), a scale per 16, c = 0 */
#define TWO_SCALES 1
  const int p = u % 8, h = p / 4, k = p % 4;
  const unsigned char* ql = blk + 64 * h + 32 * (k % 2);
  const unsigned char* qh = blk + 128 + 32 * h;
  const signed char* scales = (const signed char*)(blk + 192 + 8 * h + 2 * k);
  for (int i = 0; i < 8; i++) {
    const unsigned lo = load_u32_2(ql + 4 * i) >> 4 * (k / 2) & 0x0F0F0F0Fu;
    const unsigned hi = load_u32_2(qh + 4 * i) >> 2 * k & 0x03030303u;
    /* each byte v in 0..63 to v - 32 as a signed byte: set every top bit so no borrow crosses bytes, subtract,
     * flip the top bits back (x ^ 0x80 = x + 128 mod 256) */
    q[i] = (((lo | hi << 4) | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
  }
  const float d = f16(blk + 208);
  *d_lo = d * (float)scales[0];
  *d_hi = d * (float)scales[1];
  *c = 0.0f;
#endif
}

#include "qmatmul_tiled.cuh"

#else
/* ---- the GEMV route (M <= 8): one warp per output ---- */
TV_KERNEL __launch_bounds__(WARP * OUTS_PER_BLOCK)
qmatmul_k(float* __restrict__ out, unsigned char* __restrict__ scratch, const float* __restrict__ x,
          const unsigned char* __restrict__ w) {
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int m = blockIdx.y, n = blockIdx.x * OUTS_PER_BLOCK + warp;
  if (n >= TV_N) return;  /* a spare warp of the last thread block: the whole warp leaves, no shuffle waits on it */
  const float4* x_row = (const float4*)(x + (long)m * TV_K);  /* (K / 4,) */
  const unsigned char* w_row = w + (long)n * ROW_BYTES;       /* (K / 256 * TYPE_SIZE,) */
  float acc = 0.0f;
  for (int u = lane; u < TV_K / UNIT; u += WARP)
    acc += unit_dot(w_row + u / 8 * TYPE_SIZE, u % 8, x_row + u * (UNIT / 4));
  acc = warp_sum(acc);
  if (lane == 0) out[(long)m * TV_N + n] = acc;
}
#endif
