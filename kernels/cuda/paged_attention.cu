/* Paged attention for decoding, and the write that fills the KV cache, in CUDA: the twin of
 * kernels/cpu/paged_attention.c and kernels/metal/paged_attention.metal (same arguments, same algorithm; see
 * docs/phases/05-custom-kernels.md). Compiled by tinygrad's CUDA compiler (nvrtc) from this text.
 *
 * Why a hand-written kernel: the portable path (tinyvllm/attention/paged.py) gathers every row's blocks into a
 * contiguous copy, builds a causal mask, then runs QK^T, softmax and PV as separate kernels: 10 launches per layer
 * per step, and the K/V bytes cross memory three times (read from the blocks, written as the copy, read back).
 * For the default model (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64) one token of context holds
 *     K + V = 2 x 3 x 64 x 4 B = 1,536 B per layer (768 B in float16),  x 30 layers = 46 KB (23 KB),
 * so at context 2048 one sequence's step reads 94 MB of K/V here, in place through the block table, against
 * ~283 MB moved by the gather; and 2 launches per layer instead of 10: 60 per step instead of 300. On a GPU,
 * where a launch costs a few microseconds and a small model's step is a few milliseconds, both matter.
 *
 * One thread block = one sequence x one KV head, NUM_THREADS = 4 warps of 32 threads:
 *
 *     grid (n_kv_heads, num_seqs)       block: warp 0 | warp 1 | warp 2 | warp 3
 *     the sequence's keys, tiles of 32:   0..31   32..63   64..95   96..127   128..159 (warp 0 again) ...
 *     inside a warp, one key at a time:   lane j holds dims j, j+32, ... of q, k and v (coalesced row loads);
 *                                         a butterfly of shuffles sums the dot product onto every lane
 *
 * Key p of the sequence is found through the block table: slot = block_tables[seq, p / block_size] * block_size
 * + p % block_size (key_index below); a tile spans several blocks when block_size < 32. The GROUP = n_heads /
 * n_kv_heads query heads that share the KV head are all computed here, so each K/V row is loaded once for GROUP
 * heads. Each warp keeps its own online softmax over the tiles it took (per tile of scores s_1..s_n:
 * m' = max(m, s_i); alpha = exp(m - m'); p_i = exp(s_i - m'); l' = alpha l + sum p_i; acc' = alpha acc + sum p_i v_i);
 * at the end the 4 warps' (m, l, acc) are merged through shared memory the same way:
 * M = max m_w, out = sum_w exp(m_w - M) acc_w / sum_w exp(m_w - M) l_w.
 *
 * Flash-decoding (Tri Dao et al., 2023; vLLM's paged_attention_v2), the split route for few rows and long tables
 * (tinyvllm/attention/kernel_backend.py, gpu_attention_launches, chooses): with one block per sequence x KV head a
 * single SmolLM2 sequence keeps 3 blocks busy whatever the context, so a GPU's other SMs idle while those 3 walk
 * every key. paged_attention_split runs the same code on one partition of TV_PARTITION_SIZE keys per block:
 *
 *     grid (n_kv_heads x NUM_PARTS, num_seqs)   block (kv_head + n_kv_heads * part, seq): keys part * P ..
 *                                               part * P + P - 1 of row seq (P = TV_PARTITION_SIZE)
 *     then, instead of out:                     its merged (m, l, acc) per head -> partials[seq, head, part, :]
 *     paged_attention_reduce, grid (n_heads, num_seqs): the row's partitions merged as the warps are,
 *                                               one level up:
 *                                               out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p
 *
 * A context of 8192 keys is then read by 16 x 3 blocks instead of 3, at the price of one more launch and the
 * partials' (n_heads x NUM_PARTS x (2 + head_dim)) floats per row written and read back.
 *
 * Arguments of paged_attention (row-major; TV_T is float or half, TV_CACHE_T float, half, signed or unsigned char):
 *   out:          (num_seqs, n_heads, head_dim)       TV_T, written
 *   q:            (num_seqs, n_heads, head_dim)       TV_T, one query token per row
 *   k_cache:      (num_blocks, block_size, n_kv_heads, head_dim)   TV_CACHE_T
 *   v_cache:      (num_blocks, block_size, n_kv_heads, head_dim)   TV_CACHE_T
 *   k_scale:      (num_blocks, block_size, n_kv_heads)   float, int8 and fp8 caches only: one scale per token
 *   v_scale:      (num_blocks, block_size, n_kv_heads)   float   per KV head
 *   block_tables: (num_seqs, max_blocks)   int32     row i: the physical blocks of row i's sequence, in order
 *   context_lens: (num_seqs,)              int32     row i attends to its keys 0 .. context_lens[i]-1
 * Arguments of paged_attention_split: those of paged_attention, with out replaced by
 *   partials:     (num_seqs, n_heads, NUM_PARTS, 2 + head_dim)   float32, written: m, l, acc[head_dim] per partition
 * Arguments of paged_attention_reduce (grid (n_heads, num_seqs)):
 *   out:          (num_seqs, n_heads, head_dim)   TV_T, written
 *   partials:     (num_seqs, n_heads, NUM_PARTS, 2 + head_dim)   float32
 *   context_lens: (num_seqs,)   int32
 * Arguments of reshape_and_cache (grid: one block per token):
 *   k_cache, v_cache: (num_blocks, block_size, n_kv_heads, head_dim)   TV_CACHE_T, written at the given slots only
 *   k_scale, v_scale: (num_blocks, block_size, n_kv_heads)             float, int8 and fp8 only, the same slots
 *   key, value:       (num_tokens, n_kv_heads, head_dim)               TV_T, this step's new K and V
 *   slot_mapping:     (num_tokens,) int32   slot = block * block_size + offset; a negative slot is skipped
 * Compile-time constants: TV_NUM_SEQS, TV_NUM_HEADS, TV_NUM_KV_HEADS, TV_HEAD_DIM, TV_BLOCK_SIZE, TV_MAX_BLOCKS,
 * TV_SCALE, TV_NUM_THREADS; TV_NUM_TOKENS, TV_NUM_SLOTS; TV_T, TV_CACHE_T, TV_KV_QUANT; TV_KERNEL (extern "C"
 * __global__ void). One entry point per compilation, as on the CPU: TV_RESHAPE_AND_CACHE selects the write,
 * TV_PAGED_ATTENTION_SPLIT and TV_PAGED_ATTENTION_REDUCE (with TV_PARTITION_SIZE) flash-decoding's two kernels,
 * otherwise the attention.
 *
 * Quantized caches (Phase 7c, docs/phases/07c-kv-cache-quantization.md; the layout of kernels/cpu/paged_attention.c):
 * TV_KV_QUANT 0 stores TV_CACHE_T as is; 1 int8 codes, x = code * scale; 2 fp8 e4m3 codes, x = e4m3(code) * scale,
 * with one float scale per token per KV head (amax / 127 or amax / 448), computed by the write as
 * tinyvllm/attention/kv_quant.py does. In the attention the K scale multiplies the finished dot product (one multiply
 * per key) and the V scale each decoded element. fp8 conversions are native cvt instructions on sm_89+ (Ada,
 * Hopper: cvt.rn.satfinite.e4m3x2.f32 and cvt.rn.f16x2.e4m3x2), and the same bit arithmetic as the CPU elsewhere.
 */
#include <cuda_fp16.h>

#ifndef TV_SLIDING_WINDOW  /* a sliding-window layer's W (keys a query sees); 0: the whole context */
#define TV_SLIDING_WINDOW 0
#endif
#define WARP 32
#define NUM_WARPS (TV_NUM_THREADS / WARP)
#define GROUP (TV_NUM_HEADS / TV_NUM_KV_HEADS)   /* query heads per KV head */
#define ROW (TV_NUM_KV_HEADS * TV_HEAD_DIM)      /* elements from one token's K (or V) row to the next token's */
#define TILE 32                                  /* keys per step of the online softmax (one rescale per tile) */
#define DIMS_PER_LANE ((TV_HEAD_DIM + WARP - 1) / WARP)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(signed char x) { return (float)x; }  /* an int8 code (Phase 7c) */
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

/* ------------------------------------------------------------------- the cache's element <-> float (Phase 7c) */
#ifndef TV_KV_QUANT
#define TV_KV_QUANT 0
#endif
#define KV_INT8 1
#define KV_FP8 2
#if TV_KV_QUANT == KV_INT8
#define QMAX 127.0f
#elif TV_KV_QUANT == KV_FP8
#define QMAX 448.0f
#endif

/* fp8 e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; normals 2^(e-7) (1 + m/8), subnormals m 2^-9, max 448 */
__device__ __forceinline__ unsigned char fp8_e4m3_encode(float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short pair;  /* two codes: y in the low byte (cvt puts its second source there), 0 in the high one */
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(y));
  return (unsigned char)(pair & 0xFF);
#else
  float a = fminf(fabsf(y), 448.0f);  /* saturate */
  const unsigned bits = __float_as_uint(a);
  const unsigned magnitude = a < 0.015625f ? (unsigned)rintf(a * 512.0f)  /* below 2^-6: subnormal, m * 2^-9 */
                                           : ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  return (unsigned char)(magnitude | ((__float_as_uint(y) >> 24) & 0x80u));
#endif
}

__device__ __forceinline__ float fp8_e4m3_decode(unsigned char code) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned pair;  /* f16x2 */
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"((unsigned short)code));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(pair & 0xFFFF)));
  return f;
#else
  const unsigned magnitude = code & 0x7Fu;
  const float value = magnitude < 8 ? (float)magnitude * 0.001953125f  /* subnormal: m * 2^-9 */
                                    : __uint_as_float((magnitude << 20) + (120u << 23));
  return code & 0x80u ? -value : value;
#endif
}

/* one element of the cache as a float, before its row's scale */
__device__ __forceinline__ float cache_to_float(TV_CACHE_T x) {
#if TV_KV_QUANT == KV_FP8
  return fp8_e4m3_decode(x);
#else
  return to_float(x);  /* float, half, or an int8 code */
#endif
}

/* flash-decoding's partials (paged_attention_split writes them, paged_attention_reduce merges them) */
#ifdef TV_PARTITION_SIZE
#define NUM_PARTS ((TV_MAX_BLOCKS * TV_BLOCK_SIZE + TV_PARTITION_SIZE - 1) / TV_PARTITION_SIZE)  /* per row, at most */
#define PARTIAL (2 + TV_HEAD_DIM)  /* floats per (row, head, partition): m, l, acc[head_dim] */
#endif

/* ------------------------------------------------------------------------------------------------ the write */
#ifdef TV_RESHAPE_AND_CACHE
TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
reshape_and_cache(TV_CACHE_T* __restrict__ k_cache, TV_CACHE_T* __restrict__ v_cache,
#if TV_KV_QUANT
                  float* __restrict__ k_scale, float* __restrict__ v_scale,
#endif
                  const TV_T* __restrict__ key, const TV_T* __restrict__ value, const int* __restrict__ slot_mapping) {
  const int i = blockIdx.x;
  const long slot = slot_mapping[i];
  if (slot < 0 || slot >= TV_NUM_SLOTS) return;  /* padding token (vLLM's -1), or no such slot */
#if TV_KV_QUANT
  /* one thread per row to quantize: K or V of one KV head (2 x n_kv_heads threads busy; a token's write is small) */
  for (int r = threadIdx.x; r < 2 * TV_NUM_KV_HEADS; r += blockDim.x) {
    const int h = r % TV_NUM_KV_HEADS;
    const TV_T* x = (r < TV_NUM_KV_HEADS ? key : value) + i * ROW + h * TV_HEAD_DIM;
    TV_CACHE_T* dst = (r < TV_NUM_KV_HEADS ? k_cache : v_cache) + slot * ROW + h * TV_HEAD_DIM;
    float amax = 0.0f;
    for (int d = 0; d < TV_HEAD_DIM; d++) amax = fmaxf(amax, fabsf(to_float(x[d])));
    (r < TV_NUM_KV_HEADS ? k_scale : v_scale)[slot * TV_NUM_KV_HEADS + h] = amax * (1.0f / QMAX);
    const float inv = amax > 0.0f ? QMAX / amax : 0.0f;  /* as tinygrad: one division, then x * inv */
    for (int d = 0; d < TV_HEAD_DIM; d++) {
#if TV_KV_QUANT == KV_INT8
      dst[d] = (signed char)rintf(to_float(x[d]) * inv);  /* round half to even, |code| <= 127 */
#else
      dst[d] = fp8_e4m3_encode(to_float(x[d]) * inv);
#endif
    }
  }
#else
  for (int j = threadIdx.x; j < ROW; j += blockDim.x) {
    k_cache[slot * ROW + j] = from_float<TV_CACHE_T>(to_float(key[i * ROW + j]));
    v_cache[slot * ROW + j] = from_float<TV_CACHE_T>(to_float(value[i * ROW + j]));
  }
#endif
}

#elif defined(TV_PAGED_ATTENTION_REDUCE)
/* ------------------------------------------------------------------------------- flash-decoding's merge */
/* grid (n_heads, num_seqs): out[seq, head] from the row's partitions that hold keys, merged as the warps are:
 * out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p, M = max_p m_p. One thread per element of head_dim. */
TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
paged_attention_reduce(TV_T* __restrict__ out, const float* __restrict__ partials,
                       const int* __restrict__ context_lens) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int num_keys = min(context_lens[seq], TV_MAX_BLOCKS * TV_BLOCK_SIZE);
  const int parts = (num_keys + TV_PARTITION_SIZE - 1) / TV_PARTITION_SIZE;
  const float* row = partials + (long)(seq * TV_NUM_HEADS + head) * NUM_PARTS * PARTIAL;  /* (NUM_PARTS, PARTIAL) */
  for (int d = threadIdx.x; d < TV_HEAD_DIM; d += TV_NUM_THREADS) {
    float big_m = NEG_INF;
    for (int p = 0; p < parts; p++) big_m = fmaxf(big_m, row[p * PARTIAL]);
    float num = 0.0f, den = 0.0f;
    for (int p = 0; p < parts; p++) {
      const float m = row[p * PARTIAL];
      const float scale = m == NEG_INF ? 0.0f : expf(m - big_m);
      num += scale * row[p * PARTIAL + 2 + d];
      den += scale * row[p * PARTIAL + 1];
    }
    out[(seq * TV_NUM_HEADS + head) * TV_HEAD_DIM + d] = from_float<TV_T>(den > 0.0f ? num / den : 0.0f);
  }
}

#else
/* -------------------------------------------------------------------------------------------- the attention */
/* the sum of x over the warp, on every lane (xor butterfly: 5 shuffles) */
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = WARP / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

/* where token p of a sequence keeps its K (or V) for one KV head: slot = table[p / block_size] * block_size
 * + p % block_size, then (slot, kv_head): its scale's index, and times head_dim its row's first element.
 * A tile of keys spans several blocks when block_size < TILE. */
__device__ __forceinline__ long key_index(const int* table, int p, int kv_head) {
  return ((long)table[p / TV_BLOCK_SIZE] * TV_BLOCK_SIZE + p % TV_BLOCK_SIZE) * TV_NUM_KV_HEADS + kv_head;
}

#if TV_KV_QUANT
#define ROW_SCALE(scales, index) ((scales)[index])
#else
#define ROW_SCALE(scales, index) 1.0f
#endif

#ifdef TV_PAGED_ATTENTION_SPLIT
/* flash-decoding: thread block (kv_head + n_kv_heads * part, seq) takes only keys part * PARTITION_SIZE ..
 * (part + 1) * PARTITION_SIZE - 1 of its row and writes its merged (m, l, acc) to `out`, the partials:
 * (num_seqs, n_heads, NUM_PARTS, 2 + head_dim) float32, [m, l, acc[head_dim]]; paged_attention_reduce merges them */
#define ENTRY paged_attention_split
#define OUT_T float
#else
#define ENTRY paged_attention
#define OUT_T TV_T
#endif

TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
ENTRY(OUT_T* __restrict__ out, const TV_T* __restrict__ q, const TV_CACHE_T* __restrict__ k_cache,
      const TV_CACHE_T* __restrict__ v_cache,
#if TV_KV_QUANT
      const float* __restrict__ k_scale, const float* __restrict__ v_scale,
#endif
      const int* __restrict__ block_tables, const int* __restrict__ context_lens) {
#ifdef TV_PAGED_ATTENTION_SPLIT
  const int kv_head = blockIdx.x % TV_NUM_KV_HEADS, part = blockIdx.x / TV_NUM_KV_HEADS, seq = blockIdx.y;
#else
  const int kv_head = blockIdx.x, seq = blockIdx.y;
#endif
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int context_len = context_lens[seq];
  const int* table = block_tables + seq * TV_MAX_BLOCKS;
  const TV_T* q_group = q + (seq * TV_NUM_HEADS + kv_head * GROUP) * TV_HEAD_DIM;  /* (GROUP, head_dim) */

  __shared__ float scores[NUM_WARPS][GROUP][TILE];  /* each warp's scores, then p, for its tile */
  __shared__ float warp_m[NUM_WARPS][GROUP], warp_l[NUM_WARPS][GROUP];
  __shared__ float warp_acc[NUM_WARPS][GROUP][TV_HEAD_DIM];

  float qr[GROUP][DIMS_PER_LANE], acc[GROUP][DIMS_PER_LANE], m[GROUP], l[GROUP];
  for (int g = 0; g < GROUP; g++) {
    m[g] = NEG_INF;
    l[g] = 0.0f;
    for (int i = 0; i < DIMS_PER_LANE; i++) {
      const int d = lane + i * WARP;
      qr[g][i] = d < TV_HEAD_DIM ? to_float(q_group[g * TV_HEAD_DIM + d]) : 0.0f;
      acc[g][i] = 0.0f;
    }
  }

  const int num_keys = min(context_len, TV_MAX_BLOCKS * TV_BLOCK_SIZE);
  /* a sliding window (TV_SLIDING_WINDOW > 0) starts at the window's first key: the blocks before it are skipped */
  const int first_key = TV_SLIDING_WINDOW > 0 && num_keys > TV_SLIDING_WINDOW ? num_keys - TV_SLIDING_WINDOW : 0;
#ifdef TV_PAGED_ATTENTION_SPLIT
  const int key_begin = max(first_key, part * TV_PARTITION_SIZE);
  const int key_end = min(num_keys, part * TV_PARTITION_SIZE + TV_PARTITION_SIZE);
#else
  const int key_begin = first_key, key_end = num_keys;
#endif
  /* the warps take tiles of keys in turn */
  for (int t0 = key_begin + warp * TILE; t0 < key_end; t0 += NUM_WARPS * TILE) {
    const int n = min(TILE, key_end - t0);
    /* 1. scores: each K row is loaded once (coalesced across the lanes) and used by all GROUP heads */
    for (int t = 0; t < n; t++) {
      const long index = key_index(table, t0 + t, kv_head), row = index * TV_HEAD_DIM;
      float k[DIMS_PER_LANE];
      for (int i = 0; i < DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP;
        k[i] = d < TV_HEAD_DIM ? cache_to_float(k_cache[row + d]) : 0.0f;
      }
      const float score_scale = TV_SCALE * ROW_SCALE(k_scale, index);  /* the key's scale, once per dot product */
      for (int g = 0; g < GROUP; g++) {
        float dot = 0.0f;
        for (int i = 0; i < DIMS_PER_LANE; i++) dot += qr[g][i] * k[i];
        dot = warp_sum(dot);
        if (lane == 0) scores[warp][g][t] = dot * score_scale;
      }
    }
    __syncwarp();
    /* 2. online softmax over this tile: new max, rescale the sums so far by alpha, p = exp(s - m') */
    for (int g = 0; g < GROUP; g++) {
      float m_new = m[g];
      for (int t = 0; t < n; t++) m_new = fmaxf(m_new, scores[warp][g][t]);
      const float alpha = expf(m[g] - m_new);  /* exp(-inf) = 0 on the warp's first tile */
      __syncwarp();  /* every lane has read the scores before they are overwritten */
      for (int t = lane; t < n; t += WARP) scores[warp][g][t] = expf(scores[warp][g][t] - m_new);  /* now p */
      __syncwarp();
      float sum = 0.0f;
      for (int t = 0; t < n; t++) sum += scores[warp][g][t];
      m[g] = m_new;
      l[g] = l[g] * alpha + sum;
      for (int i = 0; i < DIMS_PER_LANE; i++) acc[g][i] *= alpha;
    }
    __syncwarp();
    /* 3. acc += p_t v_t: each V row is loaded once and used by all GROUP heads */
    for (int t = 0; t < n; t++) {
      const long index = key_index(table, t0 + t, kv_head), row = index * TV_HEAD_DIM;
      const float v_row_scale = ROW_SCALE(v_scale, index);
      for (int i = 0; i < DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP;
        const float v = d < TV_HEAD_DIM ? cache_to_float(v_cache[row + d]) * v_row_scale : 0.0f;
        for (int g = 0; g < GROUP; g++) acc[g][i] += scores[warp][g][t] * v;
      }
    }
    __syncwarp();
  }

  /* merge the warps: out = sum_w exp(m_w - M) acc_w / sum_w exp(m_w - M) l_w, M = max_w m_w */
  for (int g = 0; g < GROUP; g++) {
    if (lane == 0) {
      warp_m[warp][g] = m[g];
      warp_l[warp][g] = l[g];
    }
    for (int i = 0; i < DIMS_PER_LANE; i++) {
      const int d = lane + i * WARP;
      if (d < TV_HEAD_DIM) warp_acc[warp][g][d] = acc[g][i];
    }
  }
  __syncthreads();
#ifndef TV_PAGED_ATTENTION_SPLIT
  TV_T* out_group = out + (seq * TV_NUM_HEADS + kv_head * GROUP) * TV_HEAD_DIM;
#endif
  for (int j = threadIdx.x; j < GROUP * TV_HEAD_DIM; j += TV_NUM_THREADS) {
    const int g = j / TV_HEAD_DIM, d = j % TV_HEAD_DIM;
    float big_m = NEG_INF;
    for (int w = 0; w < NUM_WARPS; w++) big_m = fmaxf(big_m, warp_m[w][g]);
    float num = 0.0f, den = 0.0f;
    for (int w = 0; w < NUM_WARPS; w++) {
      const float scale = warp_m[w][g] == NEG_INF ? 0.0f : expf(warp_m[w][g] - big_m);  /* a warp with no tile */
      num += scale * warp_acc[w][g][d];
      den += scale * warp_l[w][g];
    }
#ifdef TV_PAGED_ATTENTION_SPLIT
    float* partial = out + ((long)(seq * TV_NUM_HEADS + kv_head * GROUP + g) * NUM_PARTS + part) * PARTIAL;
    if (d == 0) {
      partial[0] = big_m;  /* -inf, with l = 0 and acc = 0, for a partition past the row's context */
      partial[1] = den;
    }
    partial[2 + d] = num;
#else
    out_group[j] = from_float<TV_T>(den > 0.0f ? num / den : 0.0f);  /* an empty context gives zeros */
#endif
  }
}
#endif
