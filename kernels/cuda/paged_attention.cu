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
 * + p % block_size (key_offset below); a tile spans several blocks when block_size < 32. The GROUP = n_heads /
 * n_kv_heads query heads that share the KV head are all computed here, so each K/V row is loaded once for GROUP
 * heads. Each warp keeps its own online softmax over the tiles it took (per tile of scores s_1..s_n:
 * m' = max(m, s_i); alpha = exp(m - m'); p_i = exp(s_i - m'); l' = alpha l + sum p_i; acc' = alpha acc + sum p_i v_i);
 * at the end the 4 warps' (m, l, acc) are merged through shared memory the same way:
 * M = max m_w, out = sum_w exp(m_w - M) acc_w / sum_w exp(m_w - M) l_w.
 *
 * Arguments of paged_attention (row-major; TV_T is float or half, TV_CACHE_T is float or half):
 *   out:          (num_seqs, n_heads, head_dim)       TV_T, written
 *   q:            (num_seqs, n_heads, head_dim)       TV_T, one query token per row
 *   k_cache:      (num_blocks, block_size, n_kv_heads, head_dim)   TV_CACHE_T
 *   v_cache:      (num_blocks, block_size, n_kv_heads, head_dim)   TV_CACHE_T
 *   block_tables: (num_seqs, max_blocks)   int32     row i: the physical blocks of row i's sequence, in order
 *   context_lens: (num_seqs,)              int32     row i attends to its keys 0 .. context_lens[i]-1
 * Arguments of reshape_and_cache (grid: one block per token):
 *   k_cache, v_cache: (num_blocks, block_size, n_kv_heads, head_dim)   TV_CACHE_T, written at the given slots only
 *   key, value:       (num_tokens, n_kv_heads, head_dim)               TV_T, this step's new K and V
 *   slot_mapping:     (num_tokens,) int32   slot = block * block_size + offset; a negative slot is skipped
 * Compile-time constants: TV_NUM_SEQS, TV_NUM_HEADS, TV_NUM_KV_HEADS, TV_HEAD_DIM, TV_BLOCK_SIZE, TV_MAX_BLOCKS,
 * TV_SCALE, TV_NUM_THREADS; TV_NUM_TOKENS, TV_NUM_SLOTS; TV_T, TV_CACHE_T; TV_KERNEL (extern "C" __global__ void).
 * One entry point per compilation, as on the CPU: TV_RESHAPE_AND_CACHE selects the write, otherwise the attention.
 */
#include <cuda_fp16.h>

#define WARP 32
#define NUM_WARPS (TV_NUM_THREADS / WARP)
#define GROUP (TV_NUM_HEADS / TV_NUM_KV_HEADS)   /* query heads per KV head */
#define ROW (TV_NUM_KV_HEADS * TV_HEAD_DIM)      /* elements from one token's K (or V) row to the next token's */
#define TILE 32                                  /* keys per step of the online softmax (one rescale per tile) */
#define DIMS_PER_LANE ((TV_HEAD_DIM + WARP - 1) / WARP)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

/* ------------------------------------------------------------------------------------------------ the write */
#ifdef TV_RESHAPE_AND_CACHE
TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
reshape_and_cache(TV_CACHE_T* __restrict__ k_cache, TV_CACHE_T* __restrict__ v_cache, const TV_T* __restrict__ key,
                  const TV_T* __restrict__ value, const int* __restrict__ slot_mapping) {
  const int i = blockIdx.x;
  const long slot = slot_mapping[i];
  if (slot < 0 || slot >= TV_NUM_SLOTS) return;  /* padding token (vLLM's -1), or no such slot */
  for (int j = threadIdx.x; j < ROW; j += blockDim.x) {
    k_cache[slot * ROW + j] = from_float<TV_CACHE_T>(to_float(key[i * ROW + j]));
    v_cache[slot * ROW + j] = from_float<TV_CACHE_T>(to_float(value[i * ROW + j]));
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
 * + p % block_size, then (slot, kv_head, :) of the cache. A tile of keys spans several blocks when block_size < TILE. */
__device__ __forceinline__ long key_offset(const int* table, int p, int kv_head) {
  return ((long)table[p / TV_BLOCK_SIZE] * TV_BLOCK_SIZE + p % TV_BLOCK_SIZE) * ROW + kv_head * TV_HEAD_DIM;
}

TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
paged_attention(TV_T* __restrict__ out, const TV_T* __restrict__ q, const TV_CACHE_T* __restrict__ k_cache,
                const TV_CACHE_T* __restrict__ v_cache, const int* __restrict__ block_tables,
                const int* __restrict__ context_lens) {
  const int kv_head = blockIdx.x, seq = blockIdx.y;
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
  for (int t0 = warp * TILE; t0 < num_keys; t0 += NUM_WARPS * TILE) {  /* the warps take tiles of keys in turn */
    const int n = min(TILE, num_keys - t0);
    /* 1. scores: each K row is loaded once (coalesced across the lanes) and used by all GROUP heads */
    for (int t = 0; t < n; t++) {
      const long row = key_offset(table, t0 + t, kv_head);
      float k[DIMS_PER_LANE];
      for (int i = 0; i < DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP;
        k[i] = d < TV_HEAD_DIM ? to_float(k_cache[row + d]) : 0.0f;
      }
      for (int g = 0; g < GROUP; g++) {
        float dot = 0.0f;
        for (int i = 0; i < DIMS_PER_LANE; i++) dot += qr[g][i] * k[i];
        dot = warp_sum(dot);
        if (lane == 0) scores[warp][g][t] = dot * TV_SCALE;
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
      const long row = key_offset(table, t0 + t, kv_head);
      for (int i = 0; i < DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP;
        const float v = d < TV_HEAD_DIM ? to_float(v_cache[row + d]) : 0.0f;
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
  TV_T* out_group = out + (seq * TV_NUM_HEADS + kv_head * GROUP) * TV_HEAD_DIM;
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
    out_group[j] = from_float<TV_T>(den > 0.0f ? num / den : 0.0f);  /* an empty context gives zeros */
  }
}
#endif
