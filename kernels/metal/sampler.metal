/* sampler: one token per row of logits, with each row's temperature, min-p, top-k and top-p, drawn by an
 * exponential race whose clocks are hashed from the row's key, in Metal: the twin of kernels/cuda/sampler.cu and
 * kernels/cpu/sampler.c (same arguments, same layout, same hash, same thresholds, line for line with the CUDA
 * one where the languages allow). Compiled by tinygrad's Metal compiler. tinyvllm/sample/device_sampler.py says what is computed,
 * tinyvllm/sample/noise.py how the random numbers are made.
 *
 * One threadgroup per row, NUM_THREADS threads striding over the vocabulary; every step below is one parallel
 * pass over the row and a threadgroup reduction in threadgroup memory:
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
 * Arguments (row-major), buffers 0-8:
 *   tokens:      (rows,)           int32   out: the token of each row
 *   thresholds:  (rows,)           float   out: the smallest logit the filters keep, -inf when none filters
 *   scratch:     (rows, 2, vocab)  int32   out, never read back: the row's candidate weights (float bits)
 *   logits:      (rows, vocab)     float
 *   temperature: (rows,)           float   <= 0: greedy
 *   top_k:       (rows,)           int32   <= 0 or >= vocab: off
 *   top_p:       (rows,)           float   1: off
 *   min_p:       (rows,)           float   0: off
 *   keys:        (rows, 2)         uint32  the row's draw key
 * Compile-time constants: TV_NUM_ROWS, TV_VOCAB, TV_NUM_THREADS (a power of two); TV_KERNEL (kernel void).
 */

#include <metal_stdlib>
using namespace metal;

#define NEG_INF (-INFINITY)

inline uint mix32(uint x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

inline float uniform_at(uint key0, uint key1, uint i) {
  return ((float)(mix32(mix32(i ^ key0) + key1) >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

/* Cephes' logf, as in the CPU twin: the same polynomial, so both draw the same clocks */
inline float log_approx(float x) {
  uint bits = as_type<uint>(x);
  int e = (int)(bits >> 23) - 126;
  float m = as_type<float>((bits & 0x007fffffu) | 0x3f000000u);
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
inline float exp_approx(float x) {
  int under = !(x > -87.0f);
  x = under ? -87.0f : x;
  float n = rint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  float scale = as_type<float>((uint)((int)n + 127) << 23);
  return under ? 0.0f : y * scale;
}

inline float race_score(float s, uint key0, uint key1, uint i) {
  return s - log_approx(-log_approx(uniform_at(key0, key1, i)));
}

/* a float's bits as an uint key in the same order (negative floats flipped): a < b <=> key(a) < key(b) */
inline uint order_key(float x) {
  uint b = as_type<uint>(x);
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}


/* threadgroup reductions over `red` (and `red_i`), every thread gets the result: macros, because a helper function
 * cannot take threadgroup memory the same way in Metal and in the emulation the tests run it under */
#define BARRIER threadgroup_barrier(mem_flags::mem_threadgroup)
#define BLOCK_REDUCE(combine)                              \
  for (int s = TV_NUM_THREADS / 2; s > 0; s >>= 1) {       \
    if (t < s) combine;                                    \
    BARRIER;                                               \
  }
#define BLOCK_SUM(result, x)                                \
  {                                                         \
    red[t] = (x);                                           \
    BARRIER;                                                \
    BLOCK_REDUCE(red[t] += red[t + s]);                     \
    result = red[0];                                        \
    BARRIER;                                                \
  }
#define BLOCK_MAX(result, x)                                                  \
  {                                                                           \
    red[t] = (x);                                                             \
    BARRIER;                                                                  \
    BLOCK_REDUCE(red[t] = red[t + s] > red[t] ? red[t + s] : red[t]);         \
    result = red[0];                                                          \
    BARRIER;                                                                  \
  }
#define BLOCK_ARGMAX(result, x, i)                                                                   \
  {                                                                                                  \
    red[t] = (x), red_i[t] = (i);                                                                    \
    BARRIER;                                                                                         \
    BLOCK_REDUCE(if (red[t + s] > red[t] || (red[t + s] == red[t] && red_i[t + s] < red_i[t]))       \
                   (red[t] = red[t + s], red_i[t] = red_i[t + s]));                                  \
    result = red_i[0];                                                                               \
    BARRIER;                                                                                         \
  }

TV_KERNEL sampler(device int* tokens [[buffer(0)]], device float* thresholds [[buffer(1)]],
                  device int* scratch [[buffer(2)]], const device float* logits [[buffer(3)]],
                  const device float* temperature [[buffer(4)]], const device int* top_k [[buffer(5)]],
                  const device float* top_p [[buffer(6)]], const device float* min_p [[buffer(7)]],
                  const device uint* keys [[buffer(8)]],
                  uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  threadgroup float red[TV_NUM_THREADS];
  threadgroup int red_i[TV_NUM_THREADS];
  const int row = gid.x, t = lid.x;
  const device float* l = logits + (long)row * TV_VOCAB;
  device float* weight = (device float*)(scratch + (long)row * 2 * TV_VOCAB);
  const float temp = temperature[row];
  if (!(temp > 0.0f)) { /* greedy */
    float best = NEG_INF;
    int arg = TV_VOCAB;
    for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS)
      if (l[i] > best || arg == TV_VOCAB) best = l[i], arg = i;
    int token;
    BLOCK_ARGMAX(token, best, arg);
    if (t == 0) tokens[row] = token < TV_VOCAB ? token : 0, thresholds[row] = NEG_INF;
    return;
  }
  const float inv_t = 1.0f / temp, p = top_p[row], mp = min_p[row];
  const int k = top_k[row];
  const uint key0 = keys[2 * row], key1 = keys[2 * row + 1];
  const int use_k = k > 0 && k < TV_VOCAB, use_p = p < 1.0f, use_min_p = mp > 0.0f;

  float threshold = NEG_INF; /* raw logits >= threshold survive */
  if (use_k || use_p || use_min_p) {
    float m = NEG_INF;
    for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) m = l[i] > m ? l[i] : m;
    float row_max;
    BLOCK_MAX(row_max, m);
    const float s_max = row_max * inv_t;
    const float bound = use_min_p ? log_approx(mp) : NEG_INF;
    /* a candidate: finite, and min-p keeps it */
#define CANDIDATE(x) ((x) != NEG_INF && (x) * inv_t - s_max >= bound)
    uint low = 0; /* candidates' keys >= low survive */
    if (use_k) {
      float count = 0.0f, total;
      for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) count += CANDIDATE(l[i]) ? 1.0f : 0.0f;
      BLOCK_SUM(total, count);
      if (total > (float)k) {
        /* the largest key K with count(candidates >= K) >= k: the k-th largest candidate, bit by bit */
        uint K = 0;
        for (int bit = 31; bit >= 0; bit--) {
          const uint trial = K | (1u << bit);
          float c = 0.0f, counted;
          for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) c += CANDIDATE(l[i]) && order_key(l[i]) >= trial;
          BLOCK_SUM(counted, c);
          if (counted >= (float)k) K = trial;
        }
        low = K;
      }
    }
    if (use_p) {
      float z = 0.0f, total;
      for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) {
        const float x = l[i];
        weight[i] = CANDIDATE(x) && order_key(x) >= low ? exp_approx(x * inv_t - s_max) : 0.0f;
        z += weight[i];
      }
      BLOCK_SUM(total, z);
      const float target = p * total;
      /* the largest key K whose mass at or above it reaches top_p of the total: the nucleus' last logit */
      uint K = 0; /* below `low` every weight is 0: the mass there is the total, so K ends >= low */
      for (int bit = 31; bit >= 0; bit--) {
        const uint trial = K | (1u << bit);
        float mass = 0.0f, summed;
        for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) mass += order_key(l[i]) >= trial ? weight[i] : 0.0f;
        BLOCK_SUM(summed, mass);
        if (summed >= target) K = trial;
      }
      low = K;
    }
    /* the smallest candidate at or above `low`: the threshold, an element of the row */
    float smallest = INFINITY, largest_negated;
    for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS)
      if (CANDIDATE(l[i]) && order_key(l[i]) >= low && l[i] < smallest) smallest = l[i];
    BLOCK_MAX(largest_negated, -smallest);
    threshold = -largest_negated;
#undef CANDIDATE
  }

  float best = NEG_INF;
  int arg = TV_VOCAB;
  for (int i = t; i < TV_VOCAB; i += TV_NUM_THREADS) {
    if (!(l[i] >= threshold) || l[i] == NEG_INF) continue;
    const float score = race_score(l[i] * inv_t, key0, key1, (uint)i);
    if (score > best || arg == TV_VOCAB) best = score, arg = i;
  }
  int token;
  BLOCK_ARGMAX(token, best, arg);
  if (t == 0) tokens[row] = token < TV_VOCAB ? token : 0, thresholds[row] = threshold;
}
