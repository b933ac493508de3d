/* sampler: one token per row of logits, with each row's temperature, min-p, top-k and top-p, drawn by an
 * exponential race whose clocks are hashed from the row's key, in CUDA: the twin of kernels/cpu/sampler.c and
 * kernels/metal/sampler.metal (same arguments, same layout, same hash, same thresholds). Compiled by tinygrad's
 * CUDA compiler (nvrtc) from this text. tinyvllm/sample/device_sampler.py says what is computed,
 * tinyvllm/sample/noise.py how the random numbers are made.
 *
 * One thread block per row, NUM_THREADS threads striding over the vocabulary; every step below is one parallel
 * pass over the row and a block reduction in shared memory:
 *
 *     temperature <= 0   argmax (the lowest id among equal logits)
 *     no filter          the race: argmax of logit/T - log(-log u_i), one pass
 *     min-p              the row's max, then candidates: logit/T - max/T >= log(min_p)
 *     top-k              the k-th largest candidate, found bit by bit on its order-preserving 32-bit key: 32
 *                        passes, each counting the candidates >= a key (exact: the result is an element)
 *     top-p              each candidate's weight exp(logit/T - max/T) into the scratch row (one pass), then the
 *                        largest key whose mass at or above it reaches top_p of the total, bit by bit (32 passes
 *                        over the weights; the result is an element, ties kept together)
 *     draw               the race over the tokens at or above the threshold
 *
 * Unlike the CPU twin, which orders only a few candidates, the threshold searches here are fixed counts of
 * passes over the row: cheap on a GPU (each pass is a coalesced read of the row by the block, from L2), and no
 * atomics or sorting. The CPU kernel and this one agree on every threshold and (up to float rounding in a race
 * decided by ~1e-7) every token.
 *
 * Arguments (row-major):
 *   tokens:      (rows,)           int32   out: the token of each row
 *   thresholds:  (rows,)           float   out: the smallest logit the filters keep, -inf when none filters
 *   scratch:     (rows, 2, vocab)  int32   out, never read back: the row's candidate weights (float bits)
 *   logits:      (rows, vocab)     float
 *   temperature: (rows,)           float   <= 0: greedy
 *   top_k:       (rows,)           int32   <= 0 or >= vocab: off
 *   top_p:       (rows,)           float   1: off
 *   min_p:       (rows,)           float   0: off
 *   keys:        (rows, 2)         uint32  the row's draw key
 * Compile-time constants: TV_NUM_ROWS, TV_VOCAB, TV_NUM_THREADS (a power of two); TV_KERNEL.
 */

#define NEG_INF __int_as_float((int)0xff800000u)

__device__ __forceinline__ unsigned mix32(unsigned x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

__device__ __forceinline__ float uniform_at(unsigned key0, unsigned key1, unsigned i) {
  return ((float)(mix32(mix32(i ^ key0) + key1) >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

/* Cephes' logf, as in the CPU twin: the same polynomial, so both draw the same clocks */
__device__ __forceinline__ float log_approx(float x) {
  unsigned bits = __float_as_uint(x);
  int e = (int)(bits >> 23) - 126;
  float m = __uint_as_float((bits & 0x007fffffu) | 0x3f000000u);
  int small = m < 0.70710678f;
  e -= small;
  float f = small ? m + m - 1.0f : m - 1.0f;
  float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * (float)e;
  y += -0.5f * z;
  return f + y + 0.693359375f * (float)e;
}

/* Cephes' expf for x <= 0 (0 below -87) */
__device__ __forceinline__ float exp_approx(float x) {
  int under = !(x > -87.0f);
  x = under ? -87.0f : x;
  float n = rintf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  float scale = __uint_as_float((unsigned)((int)n + 127) << 23);
  return under ? 0.0f : y * scale;
}

__device__ __forceinline__ float race_score(float s, unsigned key0, unsigned key1, unsigned i) {
  return s - log_approx(-log_approx(uniform_at(key0, key1, i)));
}

/* a float's bits as an unsigned key in the same order (negative floats flipped): a < b <=> key(a) < key(b) */
__device__ __forceinline__ unsigned order_key(float x) {
  unsigned b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

__device__ __forceinline__ float block_sum(float x, float* red) {
  const int t = threadIdx.x;
  red[t] = x;
  __syncthreads();
  for (int s = TV_NUM_THREADS / 2; s > 0; s >>= 1) {
    if (t < s) red[t] += red[t + s];
    __syncthreads();
  }
  const float total = red[0];
  __syncthreads();
  return total;
}

__device__ __forceinline__ float block_max(float x, float* red) {
  const int t = threadIdx.x;
  red[t] = x;
  __syncthreads();
  for (int s = TV_NUM_THREADS / 2; s > 0; s >>= 1) {
    if (t < s) red[t] = red[t + s] > red[t] ? red[t + s] : red[t];
    __syncthreads();
  }
  const float m = red[0];
  __syncthreads();
  return m;
}

/* the (value, index) pair with the largest value, the lowest index among equal ones */
__device__ __forceinline__ int block_argmax(float x, int i, float* red, int* red_i) {
  const int t = threadIdx.x;
  red[t] = x, red_i[t] = i;
  __syncthreads();
  for (int s = TV_NUM_THREADS / 2; s > 0; s >>= 1) {
    if (t < s && (red[t + s] > red[t] || (red[t + s] == red[t] && red_i[t + s] < red_i[t])))
      red[t] = red[t + s], red_i[t] = red_i[t + s];
    __syncthreads();
  }
  const int best = red_i[0];
  __syncthreads();
  return best;
}

TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
sampler(int* __restrict__ tokens, float* __restrict__ thresholds, int* __restrict__ scratch,
        const float* __restrict__ logits, const float* __restrict__ temperature, const int* __restrict__ top_k,
        const float* __restrict__ top_p, const float* __restrict__ min_p, const unsigned* __restrict__ keys) {
  __shared__ float red[TV_NUM_THREADS];
  __shared__ int red_i[TV_NUM_THREADS];
  const int row = blockIdx.x, t = threadIdx.x;
  const float* l = logits + (long)row * TV_VOCAB;
  float* weight = (float*)(scratch + (long)row * 2 * TV_VOCAB);
  const float temp = temperature[row];
  if (!(temp > 0.0f)) { /* greedy */
    float best = NEG_INF;
    int arg = TV_VOCAB;
    for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS)
      if (l[i] > best || arg == TV_VOCAB) best = l[i], arg = i;
    const int token = block_argmax(best, arg, red, red_i);
    if (t == 0) tokens[row] = token < TV_VOCAB ? token : 0, thresholds[row] = NEG_INF;
    return;
  }
  const float inv_t = 1.0f / temp, p = top_p[row], mp = min_p[row];
  const int k = top_k[row];
  const unsigned key0 = keys[2 * row], key1 = keys[2 * row + 1];
  const int use_k = k > 0 && k < TV_VOCAB, use_p = p < 1.0f, use_min_p = mp > 0.0f;

  float threshold = NEG_INF; /* raw logits >= threshold survive */
  if (use_k || use_p || use_min_p) {
    float m = NEG_INF;
    for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) m = l[i] > m ? l[i] : m;
    const float s_max = block_max(m, red) * inv_t;
    const float bound = use_min_p ? log_approx(mp) : NEG_INF;
    /* a candidate: finite, and min-p keeps it */
#define CANDIDATE(x) ((x) != NEG_INF && (x) * inv_t - s_max >= bound)
    unsigned low = 0; /* candidates' keys >= low survive */
    if (use_k) {
      float count = 0.0f;
      for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) count += CANDIDATE(l[i]) ? 1.0f : 0.0f;
      if (block_sum(count, red) > (float)k) {
        /* the largest key K with count(candidates >= K) >= k: the k-th largest candidate, bit by bit */
        unsigned K = 0;
        for (int bit = 31; bit >= 0; bit--) {
          const unsigned trial = K | (1u << bit);
          float c = 0.0f;
          for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) c += CANDIDATE(l[i]) && order_key(l[i]) >= trial;
          if (block_sum(c, red) >= (float)k) K = trial;
        }
        low = K;
      }
    }
    if (use_p) {
      float z = 0.0f;
      for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) {
        const float x = l[i];
        weight[i] = CANDIDATE(x) && order_key(x) >= low ? exp_approx(x * inv_t - s_max) : 0.0f;
        z += weight[i];
      }
      const float target = p * block_sum(z, red);
      /* the largest key K whose mass at or above it reaches top_p of the total: the nucleus' last logit */
      unsigned K = 0; /* below `low` every weight is 0: the mass there is the total, so K ends >= low */
      for (int bit = 31; bit >= 0; bit--) {
        const unsigned trial = K | (1u << bit);
        float mass = 0.0f;
        for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) mass += order_key(l[i]) >= trial ? weight[i] : 0.0f;
        if (block_sum(mass, red) >= target) K = trial;
      }
      low = K;
    }
    /* the smallest candidate at or above `low`: the threshold, an element of the row */
    float smallest = -NEG_INF;
    for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS)
      if (CANDIDATE(l[i]) && order_key(l[i]) >= low && l[i] < smallest) smallest = l[i];
    threshold = -block_max(-smallest, red);
#undef CANDIDATE
  }

  float best = NEG_INF;
  int arg = TV_VOCAB;
  for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) {
    if (!(l[i] >= threshold) || l[i] == NEG_INF) continue;
    const float score = race_score(l[i] * inv_t, key0, key1, (unsigned)i);
    if (score > best || arg == TV_VOCAB) best = score, arg = i;
  }
  const int token = block_argmax(best, arg, red, red_i);
  if (t == 0) tokens[row] = token < TV_VOCAB ? token : 0, thresholds[row] = threshold;
}
