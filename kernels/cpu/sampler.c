/* sampler: one token per row of logits, with each row's temperature, min-p, top-k and top-p, drawn by an
 * exponential race whose clocks are hashed from the row's key (the twin of kernels/cuda/sampler.cu and
 * kernels/metal/sampler.metal: same arguments, same layout, same hash; tinyvllm/sample/device_sampler.py says
 * what is computed, tinyvllm/sample/noise.py how the random numbers are made).
 *
 * Why a kernel: in tinygrad's graph, the k-th largest logit and the top-p cut are found by bisection on the value,
 * ~64 reductions over the 49,152 logits of every row. Here each row is read once or twice, and everything after
 * that works on its few candidates:
 *
 *     no filter:    one pass: score_i = logit_i / T - log(clock_i), clock_i = -log(u_i(key)); the token is the argmax
 *                   (only for the tokens a cheap test on the hash bits cannot rule out: see race_row)
 *     min-p:        max pass, then candidates = the tokens with logit/T - max/T >= log(min_p)
 *     top-k:        one pass keeps a buffer of at most ~4k + 512 candidates at or above a rising cut (the k-th
 *                   largest of the buffer each time it fills: llama.cpp's "top-k first", without sorting the vocab)
 *     top-p alone:  max pass, one pass for the mass Z = sum exp(logit/T - max/T), then only the tokens that can be
 *                   in the nucleus are candidates: one whose probability p_j is at most (1 - top_p) / n (n
 *                   candidates) has at least 1 - n p_j >= top_p of mass above it, so top-p drops it
 *     top-p:        the candidates in a max-heap, popped most likely first until the mass before reaches top_p
 *                   (the few tokens of the nucleus are ordered, never the vocab); without top-k, when only the
 *                   token is wanted, the race first and a check that its winner is in the nucleus (see sample_row)
 *     draw:         the race over the surviving candidates only (a filtered token never wins)
 *
 * Ties are kept together, as on the host: every filter is "keep the logits >= a threshold", and `thresholds` gets
 * the smallest raw logit kept (-inf when nothing is filtered), from which the graph rebuilds the filtered
 * distribution for speculative decoding (tinyvllm/spec_decode).
 *
 * Arguments (row-major):
 *   tokens:      (rows,)           int32   out: the token of each row (temperature <= 0: the argmax, lowest id)
 *   thresholds:  (rows,)           float   out: the smallest logit the filters keep, -inf when none filters
 *   scratch:     (rows, 2, vocab)  int32   out, never read back: a row's candidates (logits as float bits, ids)
 *   logits:      (rows, vocab)     float
 *   temperature: (rows,)           float   <= 0: greedy
 *   top_k:       (rows,)           int32   <= 0 or >= vocab: off
 *   top_p:       (rows,)           float   1: off
 *   min_p:       (rows,)           float   0: off
 *   keys:        (rows, 2)         uint32  the row's draw key (noise.py)
 * Rows go to the thread pool (threadpool.h) when there are enough of them; each row's work is independent.
 * Compile-time constants: TV_NUM_ROWS, TV_VOCAB, TV_POOL_ADDR; TV_KERNEL (tinygrad's kernel_typedef); TV_THRESHOLDS
 * (0: only the tokens are read, and a top-p row may skip finding its threshold, writing NaN: see sample_row).
 */
#include "threadpool.h"
#include "exp_poly.h"

#define NEG_INF (-__builtin_inff())
#define PARALLEL_MIN_ROWS 8 /* fewer rows run on the calling thread: waking a helper costs more than a row */
#define CHUNK 256           /* tokens scored at a time by the unfiltered race (a stack array the compiler vectorizes) */

struct sampler_args {
  int* tokens;
  float* thresholds;
  int* scratch;
  const float* logits;
  const float* temperature;
  const int* top_k;
  const float* top_p;
  const float* min_p;
  const unsigned* keys;
};

static void sample_row(const void* ctx, int row);

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL sampler(int* restrict tokens, float* restrict thresholds, int* restrict scratch,
                  const float* restrict logits, const float* restrict temperature, const int* restrict top_k,
                  const float* restrict top_p, const float* restrict min_p, const unsigned* restrict keys) {
  struct sampler_args args = {tokens, thresholds, scratch, logits, temperature, top_k, top_p, min_p, keys};
  if (TV_NUM_ROWS >= PARALLEL_MIN_ROWS) {
    tv_parallel_for(sample_row, &args, TV_NUM_ROWS);
  } else {
    for (int r = 0; r < TV_NUM_ROWS; r++) sample_row(&args, r);
  }
}

TV_INLINE unsigned as_uint(float x) { union { float f; unsigned u; } c = {x}; return c.u; }
TV_INLINE float as_float(unsigned x) { union { unsigned u; float f; } c = {x}; return c.f; }

/* lowbias32 (noise.py): a bijection of uint32, two rounds per token with the two halves of the key */
TV_INLINE unsigned mix32(unsigned x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

/* u in (0, 1) for token i: the top 24 bits of the hash, centred in their interval, exact in float32 */
TV_INLINE float uniform_at(unsigned key0, unsigned key1, unsigned i) {
  return ((float)(mix32(mix32(i ^ key0) + key1) >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

/* log(x) for a normal float x > 0 without libc, as Cephes' logf: x = 2^e m with m in [sqrt(.5), sqrt(2)),
 * log(m) = f - f^2/2 + f^3 P(f) with f = m - 1 (relative error ~1e-7). Branch-free, so loops of it vectorize. */
TV_INLINE float log_approx(float x) {
  unsigned bits = as_uint(x);
  int e = (int)(bits >> 23) - 126;
  float m = as_float((bits & 0x007fffffu) | 0x3f000000u); /* [0.5, 1) */
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

/* exp(x) for x <= 0 without libc, as Cephes' expf (exp_poly.h): x = n ln2 + r, |r| <= ln2/2, exp(r) by a
 * polynomial, 2^n put into the exponent bits. x below -87 gives 0 (exp(-inf) = 0: a masked token weighs nothing). */
TV_INLINE float exp_approx(float x) {
  int under = !(x > -87.0f);
  x = under ? -87.0f : x;
  float n = __builtin_rintf(x * 1.44269504088896341f);
  float y = TV_EXP_REDUCED(float, x, n);  /* exp(x - n ln2) */
  float scale = as_float((unsigned)((int)n + 127) << 23);
  return under ? 0.0f : y * scale;
}

/* the race's score of a token with scaled logit s: s - log(clock), clock = -log(u) ~ Exp(1). argmax over tokens of
 * s_i - log(clock_i) = argmax p_i / clock_i: token i wins with probability p_i (sampler.random_sample) */
TV_INLINE float race_score(float s, unsigned key0, unsigned key1, unsigned i) {
  return s - log_approx(-log_approx(uniform_at(key0, key1, i)));
}

/* 8 floats (ints) at a time, loaded from any 4-byte aligned address: the max reductions and the candidate test
 * below are written with them because the compiler does not vectorize a float reduction on its own (without
 * -ffast-math it may not reorder the comparisons) */
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int i8 __attribute__((vector_size(32), aligned(4)));

TV_INLINE int any8(i8 mask) {
  int any = 0;
  for (int j = 0; j < 8; j++) any |= mask[j];
  return any;
}

/* the largest of x[0:n] (-inf for n = 0; NaN ignored) */
static float max_of(const float* restrict x, int n) {
  f8 m0 = (f8){0} + NEG_INF, m1 = m0;
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = __builtin_elementwise_max(m0, *(const f8*)(x + i));
    m1 = __builtin_elementwise_max(m1, *(const f8*)(x + i + 8));
  }
  m0 = __builtin_elementwise_max(m0, m1);
  float m = NEG_INF;
  for (int j = 0; j < 8; j++) m = m0[j] > m ? m0[j] : m;
  for (; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

/* the first i with x[i] == value (n if none) */
static int first_equal(const float* restrict x, int n, float value) {
  const f8 v = (f8){0} + value;
  int i = 0;
  for (; i + 8 <= n && !any8(*(const f8*)(x + i) == v); i += 8) continue;
  for (; i < n; i++)
    if (x[i] == value) return i;
  return n;
}

/* the sum of x[0:n], 8 lanes at a time */
static float sum_of(const float* restrict x, int n) {
  f8 s = (f8){0};
  int i = 0;
  for (; i + 8 <= n; i += 8) s += *(const f8*)(x + i);
  float total = 0.0f;
  for (int j = 0; j < 8; j++) total += s[j];
  for (; i < n; i++) total += x[i];
  return total;
}

/* the first index of the largest value (the lowest id among equal ones, like argmax on the host) */
static int argmax_row(const float* restrict x, int n) {
  const int i = first_equal(x, n, max_of(x, n));
  return i < n ? i : 0; /* every entry NaN */
}

/* The race over the whole row (no filter), without two logs per token. Token i beats the best score so far only if
 * its Gumbel noise G_i = -log(-log u_i) exceeds d_i = best - s_i, that is only if u_i > exp(-exp(-d_i)). Since
 * exp(-x) >= 1 - x, a token whose 1 - u_i is at least 2 exp(-d_i) cannot (it falls short by more than log 2), and
 * that test needs no log: the exponent bits of 1 - u_i are a lower bound of its log2. So a first, vectorized loop
 * hashes every token and keeps only those the test cannot rule out: the tokens near the best score, and the rare
 * ones whose u_i is within ~exp(-d_i) of 1 (about sum_i exp(s_i - best), a few hundred in a flat row). Only they
 * get the full score. The row's argmax goes first, so that the bar is high from the start. Skipping changes no
 * token: every skipped token's score is below the best by more than the logs' rounding. Tokens whose scaled logit
 * is below s_max + bound (min-p's) are not in the race. */
#define LOG2E 1.44269504f
static int race_row(const float* restrict logits, float inv_t, float s_max, float bound, unsigned key0,
                    unsigned key1) {
  int token = argmax_row(logits, TV_VOCAB); /* min-p keeps it: its scaled logit is s_max */
  float best = race_score(logits[token] * inv_t, key0, key1, (unsigned)token);
  for (int base = 0; base < TV_VOCAB; base += CHUNK) {
    const int count = TV_VOCAB - base < CHUNK ? TV_VOCAB - base : CHUNK;
    int maybe[CHUNK], any = 0;
    for (int j = 0; j < count; j++) {
      const unsigned h = mix32(mix32((unsigned)(base + j) ^ key0) + key1) >> 8;
      const float tail = ((float)(16777215u - h) + 0.5f) * (1.0f / 16777216.0f); /* 1 - u, exactly */
      const float log2_floor = (float)((int)(as_uint(tail) >> 23) - 127);       /* <= log2(1 - u) */
      const float s = logits[base + j] * inv_t;
      maybe[j] = log2_floor < (s - best) * LOG2E + 1.0f && s - s_max >= bound; /* and min-p keeps it */
      any |= maybe[j];
    }
    if (!any) continue;
    for (int j = 0; j < count; j++) {
      if (!maybe[j]) continue;
      const float score = race_score(logits[base + j] * inv_t, key0, key1, (unsigned)(base + j));
      if (score > best || (score == best && base + j < token)) best = score, token = base + j;
    }
  }
  return token;
}

TV_INLINE void swap_pair(float* v, int* id, int a, int b) {
  float tv = v[a]; v[a] = v[b]; v[b] = tv;
  int ti = id[a]; id[a] = id[b]; id[b] = ti;
}

/* The k-th largest of v[0:n] (1 <= k <= n), by quickselect with a three-way partition (ties do not make it
 * quadratic). Reorders the (v, id) pairs, keeping them together. */
static float kth_largest(float* v, int* id, int n, int k) {
  int lo = 0, hi = n;
  const int target = k - 1;
  while (hi - lo > 1) {
    float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
    float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b)); /* median of three */
    int lt = lo, i = lo, gt = hi; /* [lo, lt) > pivot, [lt, gt) == pivot, [gt, hi) < pivot */
    while (i < gt) {
      if (v[i] > pivot) swap_pair(v, id, lt++, i++);
      else if (v[i] < pivot) swap_pair(v, id, i, --gt);
      else i++;
    }
    if (target < lt) hi = lt;
    else if (target >= gt) lo = gt;
    else return pivot;
  }
  return v[lo];
}

/* keep the pairs with v >= cut, in place; returns how many */
static int keep_at_least(float* v, int* id, int n, float cut) {
  int m = 0;
  for (int i = 0; i < n; i++)
    if (v[i] >= cut) v[m] = v[i], id[m] = id[i], m++;
  return m;
}

/* max-heap of the pairs by v: sift element i down */
static void sift_down(float* v, int* id, int n, int i) {
  for (;;) {
    int big = i, l = 2 * i + 1, r = l + 1;
    if (l < n && v[l] > v[big]) big = l;
    if (r < n && v[r] > v[big]) big = r;
    if (big == i) return;
    swap_pair(v, id, i, big);
    i = big;
  }
}

/* Top-p over the candidates v[0:n] (raw logits; scaled by inv_t, max scaled value s_max, total mass z of the
 * distribution top-p measures): the smallest logit whose strictly-more-likely mass is < top_p. Pops the largest
 * first from a heap, so only the nucleus is ordered. Ties: the first of equal values popped decides for all. */
static float top_p_threshold(float* v, int* id, int n, float inv_t, float s_max, double z, float top_p) {
  for (int i = n / 2 - 1; i >= 0; i--) sift_down(v, id, n, i);
  double mass_before = 0.0;
  float threshold = v[0];
  while (n > 0) {
    float top = v[0];
    if (mass_before >= top_p * z) break; /* this token, and every one after, is outside the nucleus */
    threshold = top;
    while (n > 0 && v[0] == top) { /* the whole tie group at once */
      mass_before += exp_approx(top * inv_t - s_max);
      swap_pair(v, id, 0, --n);
      sift_down(v, id, n, 0);
    }
  }
  return threshold;
}

static void sample_row(const void* ctx, int row) {
  const struct sampler_args* a = (const struct sampler_args*)ctx;
  const float* restrict logits = a->logits + (long)row * TV_VOCAB;
  const float temperature = a->temperature[row];
  if (!(temperature > 0.0f)) {
    a->tokens[row] = argmax_row(logits, TV_VOCAB);
    a->thresholds[row] = NEG_INF;
    return;
  }
  const float inv_t = 1.0f / temperature, top_p = a->top_p[row], min_p = a->min_p[row];
  const int top_k = a->top_k[row];
  const unsigned key0 = a->keys[2 * row], key1 = a->keys[2 * row + 1];
  const int use_k = top_k > 0 && top_k < TV_VOCAB, use_p = top_p < 1.0f, use_min_p = min_p > 0.0f;
  if (!use_k && !use_p && !use_min_p) {
    a->tokens[row] = race_row(logits, inv_t, 0.0f, NEG_INF, key0, key1);
    a->thresholds[row] = NEG_INF;
    return;
  }
#if !TV_THRESHOLDS
  if (use_p && !use_k) {
    /* Top-p without top-k, when only the token is wanted: race over what min-p keeps, then check that the winner
     * is in the nucleus (the mass strictly above its logit < top_p of the total), one pass. The race's winner over
     * a set is also its winner over any subset that holds it, so then it IS the race over the nucleus: the same
     * token as below, without ordering anything. It fails with probability ~1 - top_p: then the full path. */
    const float s_max = max_of(logits, TV_VOCAB) * inv_t, bound = use_min_p ? log_approx(min_p) : NEG_INF;
    const int token = race_row(logits, inv_t, s_max, bound, key0, key1);
    const float x_token = logits[token];
    double mass = 0.0, above = 0.0; /* chunks' float sums added in double: ~1e-7 relative over the vocab */
    for (int base = 0; base < TV_VOCAB; base += CHUNK) {
      const int size = TV_VOCAB - base < CHUNK ? TV_VOCAB - base : CHUNK;
      float weight[CHUNK], higher[CHUNK];
      for (int j = 0; j < size; j++) {
        const float rel = logits[base + j] * inv_t - s_max;
        weight[j] = rel >= bound ? exp_approx(rel) : 0.0f;
        higher[j] = logits[base + j] > x_token ? weight[j] : 0.0f;
      }
      mass += sum_of(weight, size);
      above += sum_of(higher, size);
    }
    if (above < top_p * mass) {
      a->tokens[row] = token;
      a->thresholds[row] = __builtin_nanf(""); /* not computed: TV_THRESHOLDS 0 */
      return;
    }
  }
#endif
  float* restrict v = (float*)(a->scratch + (long)row * 2 * TV_VOCAB); /* candidates' logits */
  int* restrict id = a->scratch + (long)row * 2 * TV_VOCAB + TV_VOCAB;  /* and their token ids */

  /* the bound a candidate's scaled logit, minus the row's largest, must reach: min-p's, and without top-k the
   * nucleus' necessary condition p_j > (1 - top_p) / n */
  float s_max = 0.0f, bound = NEG_INF;
  double z = 0.0;
  if (use_min_p || (use_p && !use_k)) {
    s_max = max_of(logits, TV_VOCAB) * inv_t;
    if (use_min_p) bound = log_approx(min_p);
    if (use_p && !use_k) {
      double mass = 0.0; /* chunks' float sums added in double: ~1e-7 relative over the vocab */
      int count = 0;
      for (int base = 0; base < TV_VOCAB; base += CHUNK) {
        const int size = TV_VOCAB - base < CHUNK ? TV_VOCAB - base : CHUNK;
        float weight[CHUNK];
        for (int j = 0; j < size; j++) {
          const float rel = logits[base + j] * inv_t - s_max;
          const int keep = rel >= bound;
          weight[j] = keep ? exp_approx(rel) : 0.0f;
          count += keep;
        }
        mass += sum_of(weight, size);
      }
      z = mass;
      /* a margin of 1e-3 for rounding: the bound only has to keep every token of the nucleus */
      const float nucleus_bound = log_approx((float)(mass * (1.0 - top_p) / count)) - 1e-3f;
      bound = nucleus_bound > bound ? nucleus_bound : bound;
    }
  }

  /* one pass: the candidates at or above the bound; with top-k, a rising cut keeps the buffer small */
  const int capacity = use_k ? 4 * top_k + 512 : TV_VOCAB + 1;
  float cut = NEG_INF;
  int n = 0, limit = capacity;
  for (int base = 0; base < TV_VOCAB; base += 8) {
    if (base + 8 <= TV_VOCAB) { /* most blocks of 8 hold no candidate once the cut has risen: one vector test */
      const f8 x8 = *(const f8*)(logits + base);
      if (!any8((x8 >= cut) & (x8 != NEG_INF) & (x8 * inv_t - s_max >= bound))) continue;
    }
    for (int i = base; i < base + 8 && i < TV_VOCAB; i++) {
      const float x = logits[i];
      if (!(x >= cut) || x == NEG_INF || !(x * inv_t - s_max >= bound)) continue;
      v[n] = x, id[n] = i, n++;
      if (n == limit) {
        cut = kth_largest(v, id, n, top_k);
        n = keep_at_least(v, id, n, cut);
        limit = n + capacity < TV_VOCAB + 1 ? n + capacity : TV_VOCAB + 1; /* ties may keep more than k */
      }
    }
  }
  if (use_k && n > top_k) n = keep_at_least(v, id, n, kth_largest(v, id, n, top_k));
  if (n == 0) { /* nothing finite to keep (a row masked everywhere): the argmax, as greedy would */
    a->tokens[row] = argmax_row(logits, TV_VOCAB);
    a->thresholds[row] = NEG_INF;
    return;
  }

  float threshold = v[0];
  for (int j = 1; j < n; j++) threshold = v[j] < threshold ? v[j] : threshold;
  if (use_p) {
    if (use_k) { /* top-p measures the mass of what top-k (and min-p) left */
      float m = v[0];
      for (int j = 1; j < n; j++) m = v[j] > m ? v[j] : m;
      s_max = m * inv_t;
      z = 0.0;
      for (int j = 0; j < n; j++) z += exp_approx(v[j] * inv_t - s_max);
    }
    threshold = top_p_threshold(v, id, n, inv_t, s_max, z, top_p);
  }

  /* the race over the survivors: the candidates at or above the threshold */
  float best = NEG_INF;
  int token = 0;
  for (int j = 0; j < n; j++) {
    if (!(v[j] >= threshold)) continue;
    const float score = race_score(v[j] * inv_t, key0, key1, (unsigned)id[j]);
    if (score > best || (score == best && id[j] < token)) best = score, token = id[j];
  }
  a->tokens[row] = token;
  a->thresholds[row] = threshold;
}
