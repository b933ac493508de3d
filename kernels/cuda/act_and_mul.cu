/* act_and_mul: the MLP's gated activation, out = act(gate) * up, in CUDA: the twin of kernels/cpu/act_and_mul.c and
 * kernels/metal/act_and_mul.metal (same arguments, same layout). Compiled by tinygrad's CUDA compiler (nvrtc).
 * vLLM's silu_and_mul and gelu_tanh_and_mul (csrc/activation_kernels.cu) take the same input: gate_up_proj's
 * output, [gate | up] side by side in each row.
 *
 *     silu(g)      = g / (1 + exp(-g))
 *     gelu_tanh(g) = 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)),  y = sqrt(2/pi) (g + 0.044715 g^3)
 *
 * One thread per output element: grid (ceil(R F / NUM_THREADS)), NUM_THREADS threads; neighbouring threads read
 * neighbouring gates and ups (coalesced).
 *
 * Arguments (row-major):
 *   out: (R, F) float32, written
 *   x:   (R, 2F) float32, row r = [gate_r (F) | up_r (F)]
 * Compile-time constants: TV_R, TV_F, TV_GELU (0: silu, 1: gelu_tanh), TV_NUM_THREADS; TV_KERNEL.
 */

TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
act_and_mul(float* __restrict__ out, const float* __restrict__ x) {
  const long i = (long)blockIdx.x * TV_NUM_THREADS + threadIdx.x;
  if (i >= (long)TV_R * TV_F) return;
  const long r = i / TV_F, c = i % TV_F;
  const float g = x[r * 2 * TV_F + c], u = x[r * 2 * TV_F + TV_F + c];
#if TV_GELU
  const float a = 2.0f * 0.7978845608f * (g + 0.044715f * g * g * g);
#else
  const float a = g;
#endif
  out[i] = g / (1.0f + expf(-a)) * u;
}
