/* act_and_mul: the MLP's gated activation, out = act(gate) * up, in Metal: the twin of kernels/cuda/act_and_mul.cu
 * and kernels/cpu/act_and_mul.c (same arguments, same layout, line for line where the languages allow). Compiled by
 * tinygrad's Metal compiler. vLLM's silu_and_mul and gelu_tanh_and_mul take the same input: gate_up_proj's output,
 * [gate | up] side by side in each row.
 *
 *     silu(g)      = g / (1 + exp(-g))
 *     gelu_tanh(g) = 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)),  y = sqrt(2/pi) (g + 0.044715 g^3)
 *
 * One thread per output element: grid (ceil(R F / NUM_THREADS)) threadgroups of NUM_THREADS threads.
 *
 * Arguments (row-major), buffers 0-1:
 *   out: (R, F) float32, written
 *   x:   (R, 2F) float32, row r = [gate_r (F) | up_r (F)]
 * Compile-time constants: TV_R, TV_F, TV_GELU (0: silu, 1: gelu_tanh), TV_NUM_THREADS; TV_KERNEL (kernel void).
 */
#include <metal_stdlib>
using namespace metal;

TV_KERNEL act_and_mul(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                      uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  const long i = (long)gid.x * TV_NUM_THREADS + lid.x;
  if (i >= (long)TV_R * TV_F) return;
  const long r = i / TV_F, c = i % TV_F;
  const float g = x[r * 2 * TV_F + c], u = x[r * 2 * TV_F + TV_F + c];
#if TV_GELU
  const float a = 2.0f * 0.7978845608f * (g + 0.044715f * g * g * g);
#else
  const float a = g;
#endif
  out[i] = g / (1.0f + precise::exp(-a)) * u;  /* precise: Metal's plain exp is its fast approximation */
}
