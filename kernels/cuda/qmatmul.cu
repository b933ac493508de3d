/* out = x @ dequantize(w).T with w kept in its GGUF blocks: the fused dequantize-matmul for the 32-element block
 * formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
 * and IQ4_NL, in CUDA. The twin of kernels/cpu/qmatmul.c and kernels/metal/qmatmul.metal (same
 * arguments in the same order, launched by tinyvllm/kernels/qlinear.py); the K-quants are in qmatmul_k.cu.
 * Compiled by tinygrad's CUDA compiler (nvrtc) from this text.
 *
 * Why: a decode step reads every weight once and does 2 flops with it, so its time is the weights' bytes over the
 * memory bandwidth. SmolLM2-135M has 134.5 M weights (106.2 M in the linears, 28.3 M in the tied lm_head):
 *     float32:                          134.5 M x 4 B                          = 538 MB read per token
 *     the shipped GGUF, as it is:       106.2 M x 20/32 B (Q4_1) + 28.3 M x 34/32 B (Q8_0)   =  96 MB per token
 * 5.6x fewer bytes, if the blocks are dequantized in registers on the way to the FMAs and never written back
 * as floats. A separate dequantize kernel would write the 538 MB and read them again.
 *
 * How the GEMV route's work is cut (local_size (128, 1, 1): 4 warps; grid ((N + 3) / 4, M, 1)):
 *
 *     thread block (bx, m):   warp 0 -> out[m, 4 bx]   warp 1 -> out[m, 4 bx + 1]   ...   warp 3 -> out[m, 4 bx + 3]
 *     one warp, one output:   w's row n is K / 32 blocks; lane j takes blocks j, j + 32, j + 64, ...
 *                             (one step of the warp reads 32 consecutive blocks: 640 contiguous bytes of Q4_1)
 *     one lane, one block:    dequantize the 32 weights in registers (d, m from float16), 32 float FMAs with
 *                             x[m, 32 b .. 32 b + 31]; the block's scale applied once to its sum
 *     the warp's 32 sums:     a butterfly of 5 shuffles; lane 0 writes out[m, n]
 *
 * Spare warps of the last thread block (N not a multiple of 4) leave at once. At K = 576 (SmolLM2's hidden size)
 * a row has 18 blocks, so 14 lanes idle; at batch 1 the kernel is bound by the bytes of w either way.
 *
 * Vectorised loads: x as float4 (its rows are K * 4 bytes, a multiple of 128, and tinygrad's buffers are at
 * least 16-byte aligned, so every block's 32 floats start 16-byte aligned). The weight bytes as wide as each
 * format's 2-byte-aligned or 4-byte-aligned fields allow: Q4_1's blocks are 20 bytes, so its 16 bytes of quants
 * (at byte 4) are 4-byte aligned: 4 x uint; Q4_0 (18 bytes) and Q8_0 (34 bytes) keep only 2-byte alignment for
 * theirs (at byte 2): unsigned shorts, two joined per 32-bit word.
 *
 * Two routes, chosen by the rows of x (tinyvllm/kernels/qlinear.py, gpu_launches), as llama.cpp's MMVQ and MMQ:
 *   M <= 8, this file's `qmatmul` (at its end): each lane dequantizes the weights and multiplies in float; x is
 *          read as it is and the scratch argument is unused (the CPU twin quantizes x into it);
 *   M > 8,  `quantize_x` then `qmatmul_tiled` (qmatmul_tiled.cuh, its header draws them): x quantized to 8-bit blocks
 *          in the scratch, 64 x 64 output tiles from shared memory, integer dot products. TV_QUANTIZE_X or
 *          TV_QMATMUL_TILED selects that entry; this file gives it `load_unit`, its blocks as 8-bit words.
 *
 * Arguments (row-major):
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
 * Compile-time constants: TV_M, TV_N, TV_K (a multiple of 32), TV_QTYPE (ggml's type id);
 * TV_KERNEL (extern "C" __global__ void).
 */
#include <cuda_fp16.h>

#define WARP 32
#define OUTS_PER_BLOCK 4  /* warps per thread block, one output each */
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
#error "qmatmul.cu takes TV_QTYPE 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0) or 20 (IQ4_NL)"
#endif
#if TV_K % QK != 0
#error "qmatmul.cu: TV_K must be a multiple of 32 (a row is whole blocks)"
#endif
#define ROW_BYTES (TV_K / QK * TYPE_SIZE)

#include "qdot.cuh"

#if TV_QTYPE == 6 || TV_QTYPE == 7
/* Q5's fifth bits of 4 consecutive elements (bits 0-3 of v) as 4 bytes, each 16 or 0, to or into their nibbles */
__device__ __forceinline__ unsigned fifth_bits4(unsigned v) {
  return (v & 1u) << 4 | (v & 2u) << 11 | (v & 4u) << 18 | (v & 8u) << 25;
}
#endif

/* one block of w (at b) dotted with its 32 floats of x (xb: 8 float4), dequantized in registers */
__device__ __forceinline__ float block_dot(const unsigned char* b, const float4* xb) {
#if TV_QTYPE == 2  /* Q4_0: d * sum (q - 8) x; word i = bytes 4i..4i+3: elements 4i.. (low nibbles), 4i+16.. (high) */
  float s = 0.0f;
  for (int i = 0; i < 4; i++) {
    const unsigned q = load_u32_2(b + 2 + 4 * i);
    s += ubytes_dot(q & 0x0F0F0F0Fu, 8, xb[i]) + ubytes_dot(q >> 4 & 0x0F0F0F0Fu, 8, xb[4 + i]);
  }
  return f16(b) * s;
#elif TV_QTYPE == 6  /* Q5_0: d * sum (q - 16) x, q = nibble | fifth bit << 4 (bit k of qh: element k) */
  const unsigned qh = load_u32_2(b + 2);
  float s = 0.0f;
  for (int i = 0; i < 4; i++) {
    const unsigned q = load_u32_2(b + 6 + 4 * i);
    s += ubytes_dot((q & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i), 16, xb[i]) +
         ubytes_dot((q >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i)), 16, xb[4 + i]);
  }
  return f16(b) * s;
#elif TV_QTYPE == 7  /* Q5_1: d * sum q x + m * sum x, q = nibble | fifth bit << 4 (24-byte blocks: words) */
  const unsigned qh = *(const unsigned*)(b + 4);
  const unsigned* qs = (const unsigned*)(b + 8);
  float qx = 0.0f, sx = 0.0f;
  for (int i = 0; i < 4; i++) {
    qx += ubytes_dot((qs[i] & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i), 0, xb[i]) +
          ubytes_dot((qs[i] >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i)), 0, xb[4 + i]);
    sx += sum4(xb[i]) + sum4(xb[4 + i]);
  }
  return fmaf(f16(b), qx, f16(b + 2) * sx);
#elif TV_QTYPE == 3  /* Q4_1: d * sum q x + m * sum x */
  const unsigned* qs = (const unsigned*)(b + 4);
  float qx = 0.0f, sx = 0.0f;
  for (int i = 0; i < 4; i++) {
    const unsigned q = qs[i];
    qx += ubytes_dot(q & 0x0F0F0F0Fu, 0, xb[i]) + ubytes_dot(q >> 4 & 0x0F0F0F0Fu, 0, xb[4 + i]);
    sx += sum4(xb[i]) + sum4(xb[4 + i]);
  }
  return fmaf(f16(b), qx, f16(b + 2) * sx);
#elif TV_QTYPE == 20  /* IQ4_NL: d * sum values[q] x, the nibbles as Q4_0's */
  float s = 0.0f;
  for (int i = 0; i < 4; i++) {
    const unsigned q = load_u32_2(b + 2 + 4 * i);
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
/* ---- the tiled route (M > 8): qmatmul_tiled.cuh, on this file's blocks ---- */
#define TWO_SCALES 0  /* one scale per block of 32 */

/* block u of a row of w as 8 words of 4 signed bytes q (word i: elements 4i .. 4i + 3), and w = d * q + c */
__device__ __forceinline__ void load_unit(const unsigned char* w_row, int u, unsigned* q, float* d_lo, float* d_hi,
                                          float* c) {
  const unsigned char* b = w_row + u * TYPE_SIZE;
  *d_lo = *d_hi = f16(b);
#if TV_QTYPE == 2  /* Q4_0: q = nibble, c = -8 d; byte j: elements j (low nibble), j + 16 (high) */
  for (int i = 0; i < 4; i++) {
    const unsigned v = load_u32_2(b + 2 + 4 * i);
    q[i] = v & 0x0F0F0F0Fu;
    q[4 + i] = v >> 4 & 0x0F0F0F0Fu;
  }
  *c = -8.0f * *d_lo;
#elif TV_QTYPE == 6  /* Q5_0: q = nibble | fifth bit << 4, c = -16 d */
  const unsigned qh = load_u32_2(b + 2);
  for (int i = 0; i < 4; i++) {
    const unsigned v = load_u32_2(b + 6 + 4 * i);
    q[i] = (v & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i);
    q[4 + i] = (v >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i));
  }
  *c = -16.0f * *d_lo;
#elif TV_QTYPE == 7  /* Q5_1: q = nibble | fifth bit << 4, c = m */
  const unsigned qh = *(const unsigned*)(b + 4);
  const unsigned* qs = (const unsigned*)(b + 8);
  for (int i = 0; i < 4; i++) {
    q[i] = (qs[i] & 0x0F0F0F0Fu) | fifth_bits4(qh >> 4 * i);
    q[4 + i] = (qs[i] >> 4 & 0x0F0F0F0Fu) | fifth_bits4(qh >> (16 + 4 * i));
  }
  *c = f16(b + 2);
#elif TV_QTYPE == 3  /* Q4_1: q = nibble, c = m */
  const unsigned* qs = (const unsigned*)(b + 4);
  for (int i = 0; i < 4; i++) {
    q[i] = qs[i] & 0x0F0F0F0Fu;
    q[4 + i] = qs[i] >> 4 & 0x0F0F0F0Fu;
  }
  *c = f16(b + 2);
#elif TV_QTYPE == 20  /* IQ4_NL: q = values[nibble] (signed bytes), c = 0 */
  for (int i = 0; i < 4; i++) {
    const unsigned v = load_u32_2(b + 2 + 4 * i);
    q[i] = iq4nl_bytes(v & 0x0F0F0F0Fu);
    q[4 + i] = iq4nl_bytes(v >> 4 & 0x0F0F0F0Fu);
  }
  *c = 0.0f;
#else  /* Q8_0: q = the int8s as they are, c = 0 */
  for (int i = 0; i < 8; i++) q[i] = load_u32_2(b + 2 + 4 * i);
  *c = 0.0f;
#endif
}

#include "qmatmul_tiled.cuh"

#else
/* ---- the GEMV route (M <= 8): one warp per output ---- */
TV_KERNEL __launch_bounds__(WARP * OUTS_PER_BLOCK)
qmatmul(float* __restrict__ out, unsigned char* __restrict__ scratch, const float* __restrict__ x,
        const unsigned char* __restrict__ w) {
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int m = blockIdx.y, n = blockIdx.x * OUTS_PER_BLOCK + warp;
  if (n >= TV_N) return;  /* a spare warp of the last thread block: the whole warp leaves, no shuffle waits on it */
  const float4* x_row = (const float4*)(x + (long)m * TV_K);  /* (K / 4,) */
  const unsigned char* w_row = w + (long)n * ROW_BYTES;       /* (K / 32 * TYPE_SIZE,) */
  float acc = 0.0f;
  for (int b = lane; b < TV_K / QK; b += WARP) acc += block_dot(w_row + b * TYPE_SIZE, x_row + b * (QK / 4));
  acc = warp_sum(acc);
  if (lane == 0) out[(long)m * TV_N + n] = acc;
}
#endif
