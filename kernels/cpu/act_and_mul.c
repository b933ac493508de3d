/* act_and_mul: the MLP's gated activation, out = act(gate) * up, in C: the twin of kernels/cuda/act_and_mul.cu and
 * kernels/metal/act_and_mul.metal (same arguments, same layout). vLLM's silu_and_mul and gelu_tanh_and_mul
 * (csrc/activation_kernels.cu) take the same input: gate_up_proj's output, [gate | up] side by side in each row.
 *
 * Why a kernel: tinygrad's CPU backend has no exp instruction to call (kernels are linked without libc), so it
 * spells exp out as its own polynomial, 4 floats at a time with selects for the special values; in a step of many
 * rows that elementwise kernel took more time than any other but the matmuls (benchmarks/profile_decode.py
 * --batch 64). Here exp is exp_poly.h's, 8 floats at a time, and the rows are spread over the thread pool.
 *
 *     silu(g)      = g * sigmoid(g)           = g / (1 + exp(-g))                          (SwiGLU: LLaMA, Qwen)
 *     gelu_tanh(g) = 0.5 g (1 + tanh(y))      = g / (1 + exp(-2y)),  y = sqrt(2/pi) (g + 0.044715 g^3)
 *                                                                                          (GeGLU: Gemma)
 * (1 + tanh(y)) / 2 = sigmoid(2y), so both are g / (1 + exp(-a)) with a = g or 2y. exp8 clamps its argument to
 * [-87.3, 88.3]: a gate far below zero gives g / (1 + 2^126), ~0, one far above gives g.
 *
 * Arguments (row-major):
 *   out: (R, F) float32, written
 *   x:   (R, 2F) float32, row r = [gate_r (F) | up_r (F)]
 * Compile-time constants: TV_R, TV_F, TV_GELU (0: silu, 1: gelu_tanh); TV_KERNEL.
 */
#include "threadpool.h"
#include "exp_poly.h"

#if !defined(TV_R) || !defined(TV_F) || !defined(TV_GELU)
#error "act_and_mul.c needs TV_R, TV_F and TV_GELU (the launcher defines them)"
#endif
#define CHUNK_ELEMENTS 16384  /* ~64 KB of out per chunk handed to a thread: one row (F = 1536) is one tenth of it */
#define ROWS_PER_CHUNK (TV_F >= CHUNK_ELEMENTS ? 1 : CHUNK_ELEMENTS / TV_F)
#define NUM_CHUNKS ((TV_R + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK)

struct act_args {
  float* out;
  const float* x;
};

static void act_chunk(const void* ctx, int chunk);

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL act_and_mul(float* restrict out, const float* restrict x) {
  struct act_args args = {out, x};
  tv_parallel_for(act_chunk, &args, NUM_CHUNKS);
}

/* act(g) * u for 8 lanes: g / (1 + exp(-a)) * u */
TV_INLINE f8 act_mul8(f8 g, f8 u) {
#if TV_GELU
  f8 a = 2.0f * 0.7978845608f * (g + 0.044715f * g * g * g);
#else
  f8 a = g;
#endif
  return g / (1.0f + exp8(-a)) * u;
}

static void act_chunk(const void* ctx, int chunk) {
  const struct act_args* a = (const struct act_args*)ctx;
  for (int r = chunk * ROWS_PER_CHUNK; r < TV_R && r < (chunk + 1) * ROWS_PER_CHUNK; r++) {
    const float* gate = a->x + (long)r * 2 * TV_F;
    const float* up = gate + TV_F;
    float* out = a->out + (long)r * TV_F;
    int c = 0;
    for (; c + 8 <= TV_F; c += 8) *(f8*)(out + c) = act_mul8(*(const f8*)(gate + c), *(const f8*)(up + c));
    for (; c < TV_F; c++) out[c] = act_mul8((f8){0} + gate[c], (f8){0} + up[c])[0];  /* F % 8 left over */
  }
}
