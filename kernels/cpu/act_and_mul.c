/* act_and_mul: the MLP's gated activation, out = act(gate) * up, in C: the twin of kernels/cuda/act_and_mul.cu and
 * kernels/metal/act_and_mul.metal (same arguments, same layout). vLLM's silu_and_mul and gelu_tanh_and_mul
 * (csrc/activation_kernels.cu) take the same input: gate_up_proj's output, [gate | up] side by side in each row.
 *
 * Why a kernel: tinygrad's CPU backend has no exp instruction to call (kernels are linked without libc), so it
 * spells exp out as its own polynomial, 4 floats at a time with selects for the special values; in a step of many
 * rows that elementwise kernel took more time than any other but the matmuls (benchmarks/profile_decode.py
 * --batch 64). Here exp is 8 floats at a time (exp8_activation, below), and the rows are spread over the pool.
 *
 *     silu(g)      = g * sigmoid(g)           = g / (1 + exp(-g))                          (SwiGLU: LLaMA, Qwen)
 *     gelu_tanh(g) = 0.5 g (1 + tanh(y))      = g / (1 + exp(-2y)),  y = sqrt(2/pi) (g + 0.044715 g^3)
 *                                                                                          (GeGLU: Gemma)
 * (1 + tanh(y)) / 2 = sigmoid(2y), so both are g / (1 + exp(-a)) with a = g or 2y. A gate far below zero gives
 * g / (1 + 2^127 j), ~0, one far above gives g.
 *
 * Arguments (row-major):
 *   out: (R, F) float32, written
 *   x:   (R, 2F) float32, row r = [gate_r (F) | up_r (F)]
 * Compile-time constants: TV_R, TV_F, TV_GELU (0: silu, 1: gelu_tanh); TV_KERNEL.
 */
#include "threadpool.h"
#if defined(__FMA__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#if !defined(TV_R) || !defined(TV_F) || !defined(TV_GELU)
#error "act_and_mul.c needs TV_R, TV_F and TV_GELU (the launcher defines them)"
#endif
#define CHUNK_ELEMENTS 16384  /* ~64 KB of out per chunk handed to a thread: one row (F = 1536) is one tenth of it */
#define ROWS_PER_CHUNK (TV_F >= CHUNK_ELEMENTS ? 1 : CHUNK_ELEMENTS / TV_F)
#define NUM_CHUNKS ((TV_R + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK)

/* 8 floats (ints) in one AVX2 register; aligned(4) makes loads through a pointer to it unaligned loads */
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int i8 __attribute__((vector_size(32), aligned(4)));

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

/* exp for the activation: Arm's optimized-routines expf (x = n ln2 + b, |b| <= ln2/2, exp(b) by a degree-5
 * polynomial in two halves), the one llama.cpp's ggml-cpu evaluates for its SIMD silu (ggml_v_expf, AVX-512 form),
 * operation for operation: so for the same gate this kernel's silu has llama.cpp's bits. Why that matters: the
 * product goes into down_proj, whose kernel rounds it to 8-bit blocks, and a block holding one of this model's large
 * activations rounds the other 31 coarsely; an output one ulp off flips some of those roundings, and over a text
 * the model's perplexity moves by tenths of a percent with them, a sample of float rounding rather than a difference
 * in accuracy (chapter 06). Rounding as llama.cpp does keeps the two figures comparable (bench_quality). Accuracy:
 * within 1.5 ulp (exp_poly.h's Cephes polynomial, which the attention uses, is closer). 2^n is put into a float's
 * exponent bits, n clamped to [-126, 127]: past that silu's exp term is either negligible beside 1 or makes the
 * output a negligible fraction of g either way. */
TV_INLINE f8 exp8_activation(f8 x) {
#if defined(__FMA__) && defined(__AVX2__)
#define FMA8(a, b, c) ((f8)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define FNMA8(a, b, c) ((f8)_mm256_fnmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))  /* c - a b */
#else
#define FMA8(a, b, c) ((a) * (b) + (c))
#define FNMA8(a, b, c) ((c) - (a) * (b))
#endif
  const f8 shift = (f8){0} + 0x1.8p23f;  /* adding it rounds to an integer, kept in the low bits */
  f8 z = FMA8(x, (f8){0} + 0x1.715476p+0f, shift);
  f8 n = z - shift;  /* round(x / ln2) */
  f8 b = FNMA8(n, (f8){0} + 0x1.7f7d1cp-20f, FNMA8(n, (f8){0} + 0x1.62e4p-1f, x));  /* x - n ln2, ln2 in two parts */
  f8 u = b * b;
  f8 hi = FMA8(FMA8((f8){0} + 0x1.0e4020p-7f, b, (f8){0} + 0x1.573e2ep-5f), u,
               FMA8((f8){0} + 0x1.555e66p-3f, b, (f8){0} + 0x1.fffdb6p-2f));
  f8 j = FMA8(hi, u, FMA8((f8){0} + 0x1.ffffecp-1f, b, (f8){0} + 1.0f));  /* exp(b) */
  n = __builtin_elementwise_min(__builtin_elementwise_max(n, (f8){0} - 126.0f), (f8){0} + 127.0f);
  return j * (f8)(((i8)__builtin_convertvector(n, i8) + 127) << 23);  /* j 2^n */
#undef FMA8
#undef FNMA8
}

/* act(g) * u for 8 lanes: g / (1 + exp(-a)) * u */
TV_INLINE f8 act_mul8(f8 g, f8 u) {
#if TV_GELU
  f8 a = 2.0f * 0.7978845608f * (g + 0.044715f * g * g * g);
#else
  f8 a = g;
#endif
  return g / (1.0f + exp8_activation(0.0f - a)) * u;
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
