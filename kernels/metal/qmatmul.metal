/* out = x @ dequantize(w).T with w kept in its GGUF blocks: the fused dequantize-matmul for the 32-element block
 * formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
 * and IQ4_NL, in Metal. The twin of kernels/cuda/qmatmul.cu and kernels/cpu/qmatmul.c (same
 * arguments in the same order, the CUDA kernel line for line where the languages allow; launched by
 * tinyvllm/kernels/qlinear.py); the K-quants are in qmatmul_k.metal. Compiled by tinygrad's Metal compiler.
 *
 * Why: a decode step reads every weight once and does 2 flops with it, so its time is the weights' bytes over the
 * memory bandwidth. SmolLM2-135M has 134.5 M weights (106.2 M in the linears, 28.3 M in the tied lm_head):
 *     float32:                          134.5 M x 4 B                          = 538 MB read per token
 *     the shipped GGUF, as it is:       106.2 M x 20/32 B (Q4_1) + 28.3 M x 34/32 B (Q8_0)   =  96 MB per token
 * 5.6x fewer bytes, if the blocks are dequantized in registers on the way to the FMAs and never written back
 * as floats. A separate dequantize kernel would write the 538 MB and read them again.
 *
 * How the GEMV route's work is cut (threadgroups of 128 threads: 4 SIMD groups of 32, CUDA's warps;
 * grid ((N + 3) / 4, M, 1)):
 *
 *     threadgroup (gx, m):    SIMD group 0 -> out[m, 4 gx]   1 -> out[m, 4 gx + 1]   ...   3 -> out[m, 4 gx + 3]
 *     one SIMD group:         w's row n is K / 32 blocks; lane j takes blocks j, j + 32, j + 64, ...
 *                             (one step reads 32 consecutive blocks: 640 contiguous bytes of Q4_1)
 *     one lane, one block:    dequantize the 32 weights in registers (d, m from half), 32 float FMAs with
 *                             x[m, 32 b .. 32 b + 31]; the block's scale applied once to its sum
 *     the 32 lanes' sums:     simd_sum; lane 0 writes out[m, n]
 *
 * Spare SIMD groups of the last threadgroup (N not a multiple of 4) leave at once. At K = 576 (SmolLM2's hidden
 * size) a row has 18 blocks, so 14 lanes idle; at batch 1 the kernel is bound by the bytes of w either way.
 *
 * Vectorised loads: x as float4 (its rows are K * 4 bytes, a multiple of 128, and Metal buffers are at least
 * 16-byte aligned, so every block's 32 floats start 16-byte aligned). The weight bytes as wide as each format's
 * fields allow: Q4_1's blocks are 20 bytes, so its 16 bytes of quants (at byte 4) are 4-byte aligned: 4 x uint;
 * Q4_0 (18 bytes) and Q8_0 (34 bytes) keep only 2-byte alignment for theirs (at byte 2): ushorts, two joined per
 * 32-bit word.
 *
 * Two routes, chosen by the rows of x (tinyvllm/kernels/qlinear.py, gpu_launches), as llama.cpp's MMVQ and MMQ:
 *   M <= 8, this file's `qmatmul` (at its end): each lane dequantizes the weights and multiplies in float; x is
 *          read as it is and the scratch argument is unused (the CPU twin quantizes x into it);
 *   M > 8,  `quantize_x` then `qmatmul_tiled` (qmatmul_tiled.h, its header draws them): x quantized to 8-bit blocks
 *          in the scratch, 64 x 64 output tiles from shared memory, integer dot products. TV_QUANTIZE_X or
 *          TV_QMATMUL_TILED selects that entry; this file gives it `load_unit`, its blocks as 8-bit words.
 *
 * Arguments (row-major), buffers 0-3:
 *   out:     (M, N)                     float32, written
 *   scratch: (gpu_scratch_bytes(M, K),) uint8: the tiled route's x in 8-bit blocks; unused by the GEMV
 *   x:       (M, K)                     float32, the activations
 *   w:       (N, K / 32 * TYPE_SIZE)    uint8, row n = the GGUF's blocks of output feature n, as they are in the file:
 *              Q4_0 (TV_QTYPE 2):  18 B = d (f16) | qs[16]            x = d * (q - 8)
 *              Q4_1 (TV_QTYPE 3):  20 B = d (f16) | m (f16) | qs[16]  x = d * q + m
 *              Q5_0 (TV_QTYPE 6):  22 B = d (f16) | qh (u32) | qs[16] x = d * (q - 16), q = nibble | bit k of qh << 4
 *              Q5_1 (TV_QTYPE 7):  24 B = d (f16) | m (f16) | qh (u32) | qs[16]  x = d * q + m, q as Q5_0's
 *              Q8_0 (TV_QTYPE 8):  34 B = d (f16) | qs[32] int8       x = d * q
 *              IQ4_NL (TV_QTYPE 20): 18 B = d (f16) | qs[16]          x = d * values[q], 16 int8 values (qdot)
 *            (qs[16]: byte j holds element j in its low nibble, element j + 16 in its high nibble;
 *             byte layouts drawn in tinyvllm/model/quant.py)
 * Compile-time constants: TV_M, TV_N, TV_K (a multiple of 32), TV_QTYPE (ggml's type id); TV_KERNEL (kernel void).
 */
#include <metal_stdlib>
using namespace metal;

#define WARP 32           /* threads per SIMD group on Apple GPUs (threadExecutionWidth) */
#define OUTS_PER_BLOCK 4  /* SIMD groups per threadgroup, one output each */
#define QK 32             /* elements per block */

#if TV_QTYPE == 2
#define TYPE_SIZE 18
#elif TV_QTYPE == 3
#define TYPE_SIZE 20
#elif TV_QTYPE == 6
#define TYPE_SIZE 22
#elif TV_QTYPE == 7
#define TYPE_SIZE 24
#elif TV_QTYPE == 8
#define TYPE_SIZE 34
#elif TV_QTYPE == 20
#define TYPE_SIZE 18
#else
#error "qmatmul.metal takes TV_QTYPE 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0) or 20 (IQ4_NL)"
#endif
#if TV_K % QK != 0
#error "qmatmul.metal: TV_K must be a multiple of 32 (a row is whole blocks)"
#endif
#define ROW_BYTES (TV_K / QK * TYPE_SIZE)

#include "qdot.h"

#if TV_QTYPE == 6 || TV_QTYPE == 7
/* Q5's fifth bits of 4 consecutive elements (bits 0-3 of v) as 4 bytes, each 16 or 0, to or into their nibbles */
inline uint fifth_bits4(uint v) {
  return (v & 1u) << 4 | (v & 2u) << 11 | (v & 4u) << 18 | (v & 8u) << 25;
}
#endif

/* one block of w (at b) dotted with its 32 floats of x (xb: 8 float4), dequantized in registers */
inline float block_dot(const device uchar* b, const device float4* xb) {
#if TV_QTYPE == 2  /* Q4_0: d * sum (q - 8) x; word i = bytes 4i..4i+3: elements 4i.. (low nibbles), 4i+16.. (high) */
  float s = 0.0f;
  for (int i = 0; i < 4; i++) {
    const uint q = load_u32_2(b + 2 + 4 * i);
    s += ubytes_dot(q & 0x0F0F0F0Fu, 8, xb[i]) + ubytes_dot(q >> 4 & 0x0F0F0F0Fu, 8, xb[4 + i]);
  }
  return f16(b) * s;
#elif TV_QTYPE == 6  /* Q5_0: d * sum (q - 16) x, q = nibble | fifth bit << 4 (bit k of qh: element k) */
  const uint qh = load_u32_2(b + 2);
  float s = 0.0f;
  for (int i = 0; i < 4; i++) {
    const uint q = load_u32_2(b + 6 + 4 * i);
    s += ubytes_dot((q & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i), 16, xb[i]) +
         ubytes_dot((q >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i)), 16, xb[4 + i]);
  }
  return f16(b) * s;
#elif TV_QTYPE == 7  /* Q5_1: d * sum q x + m * sum x, q = nibble | fifth bit << 4 (24-byte blocks: words) */
  const uint qh = *(const device uint*)(b + 4);
  const device uint* qs = (const device uint*)(b + 8);
  float qx = 0.0f, sx = 0.0f;
  for (int i = 0; i < 4; i++) {
    qx += ubytes_dot((qs[i] & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i), 0, xb[i]) +
          ubytes_dot((qs[i] >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i)), 0, xb[4 + i]);
    sx += sum4(xb[i]) + sum4(xb[4 + i]);
  }
  return fma(f16(b), qx, f16(b + 2) * sx);
#elif TV_QTYPE == 3  /* Q4_1: d * sum q x + m * sum x */
  const device uint* qs = (const device uint*)(b + 4);
  float qx = 0.0f, sx = 0.0f;
  for (int i = 0; i < 4; i++) {
    const uint q = qs[i];
    qx += ubytes_dot(q & 0x0F0F0F0Fu, 0, xb[i]) + ubytes_dot(q >> 4 & 0x0F0F0F0Fu, 0, xb[4 + i]);
    sx += sum4(xb[i]) + sum4(xb[4 + i]);
  }
  return fma(f16(b), qx, f16(b + 2) * sx);
#elif TV_QTYPE == 20  /* IQ4_NL: d * sum values[q] x, the nibbles as Q4_0's */
  float s = 0.0f;
  for (int i = 0; i < 4; i++) {
    const uint q = load_u32_2(b + 2 + 4 * i);
    s += sbytes_dot(iq4nl_bytes(q & 0x0F0F0F0Fu), xb[i]) + sbytes_dot(iq4nl_bytes(q >> 4 & 0x0F0F0F0Fu), xb[4 + i]);
  }
  return f16(b) * s;
#else  /* Q8_0: d * sum q x; word i = elements 4i..4i+3 */
  float s = 0.0f;
  for (int i = 0; i < 8; i++) s += sbytes_dot(load_u32_2(b + 2 + 4 * i), xb[i]);
  return f16(b) * s;
#endif
}

#if defined(TV_QUANTIZE_X) || defined(TV_QMATMUL_TILED)
/* ---- the tiled route (M > 8): qmatmul_tiled.h, on this file's blocks ---- */
#define TWO_SCALES 0  /* one scale per block of 32 */

/* block u of a row of w as 8 words of 4 signed bytes q (word i: elements 4i .. 4i + 3), and w = d * q + c */
inline void load_unit(const device uchar* w_row, int u, thread uint* q, thread float& d_lo, thread float& d_hi,
                      thread float& c) {
  const device uchar* b = w_row + u * TYPE_SIZE;
  d_lo = d_hi = f16(b);
#if TV_QTYPE == 2  /* Q4_0: q = nibble, c = -8 d; byte j: elements j (low nibble), j + 16 (high) */
  for (int i = 0; i < 4; i++) {
    const uint v = load_u32_2(b + 2 + 4 * i);
    q[i] = v & 0x0F0F0F0Fu;
    q[4 + i] = v >> 4 & 0x0F0F0F0Fu;
  }
  c = -8.0f * d_lo;
#elif TV_QTYPE == 6  /* Q5_0: q = nibble | fifth bit << 4, c = -16 d */
  const uint qh = load_u32_2(b + 2);
  for (int i = 0; i < 4; i++) {
    const uint v = load_u32_2(b + 6 + 4 * i);
    q[i] = (v & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i);
    q[4 + i] = (v >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i));
  }
  c = -16.0f * d_lo;
#elif TV_QTYPE == 7  /* Q5_1: q = nibble | fifth bit << 4, c = m */
  const uint qh = *(const device uint*)(b + 4);
  const device uint* qs = (const device uint*)(b + 8);
  for (int i = 0; i < 4; i++) {
    q[i] = (qs[i] & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i);
    q[4 + i] = (qs[i] >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i));
  }
  c = f16(b + 2);
#elif TV_QTYPE == 3  /* Q4_1: q = nibble, c = m */
  const device uint* qs = (const device uint*)(b + 4);
  for (int i = 0; i < 4; i++) {
    q[i] = qs[i] & 0x0F0F0F0Fu;
    q[4 + i] = qs[i] >> 4 & 0x0F0F0F0Fu;
  }
  c = f16(b + 2);
#elif TV_QTYPE == 20  /* IQ4_NL: q = values[nibble] (signed bytes), c = 0 */
  for (int i = 0; i < 4; i++) {
    const uint v = load_u32_2(b + 2 + 4 * i);
    q[i] = iq4nl_bytes(v & 0x0F0F0F0Fu);
    q[4 + i] = iq4nl_bytes(v >> 4 & 0x0F0F0F0Fu);
  }
  c = 0.0f;
#else  /* Q8_0: q = the int8s as they are, c = 0 */
  for (int i = 0; i < 8; i++) q[i] = load_u32_2(b + 2 + 4 * i);
  c = 0.0f;
#endif
}

#include "qmatmul_tiled.h"

#else
/* ---- the GEMV route (M <= 8): one SIMD group per output ---- */
TV_KERNEL qmatmul(device float* out [[buffer(0)]], device uchar* scratch [[buffer(1)]],
                  const device float* x [[buffer(2)]], const device uchar* w [[buffer(3)]],
                  uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  const int warp = lid.x / WARP, lane = lid.x % WARP;
  const int m = gid.y, n = gid.x * OUTS_PER_BLOCK + warp;
  if (n >= TV_N) return;  /* a spare SIMD group of the last threadgroup: all of it leaves, simd_sum waits on none */
  const device float4* x_row = (const device float4*)(x + (long)m * TV_K);  /* (K / 4,) */
  const device uchar* w_row = w + (long)n * ROW_BYTES;                      /* (K / 32 * TYPE_SIZE,) */
  float acc = 0.0f;
  for (int b = lane; b < TV_K / QK; b += WARP) acc += block_dot(w_row + b * TYPE_SIZE, x_row + b * (QK / 4));
  acc = simd_sum(acc);
  if (lane == 0) out[(long)m * TV_N + n] = acc;
}
#endif
