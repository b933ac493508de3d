/* Paged attention for decoding, and the write that fills the KV cache, in Metal: the twin of
 * kernels/cuda/paged_attention.cu and kernels/cpu/paged_attention.c (same arguments, same algorithm, line for line
 * where the languages allow; see docs/phases/05-custom-kernels.md). Compiled by tinygrad's Metal compiler.
 *
 * Why a hand-written kernel: the portable path (tinyvllm/attention/paged.py) gathers every row's blocks into a
 * contiguous copy, builds a causal mask, then runs QK^T, softmax and PV as separate kernels: 10 launches per layer
 * per step, and the K/V bytes cross memory three times (read from the blocks, written as the copy, read back).
 * For the default model (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64) one token of context holds
 *     K + V = 2 x 3 x 64 x 4 B = 1,536 B per layer (768 B in float16),  x 30 layers = 46 KB (23 KB),
 * so at context 2048 one sequence's step reads 94 MB of K/V here, in place through the block table, against
 * ~283 MB moved by the gather; and 2 launches per layer instead of 10: 60 per step instead of 300.
 *
 * One threadgroup = one sequence x one KV head, NUM_THREADS = 4 SIMD groups of 32 threads (a SIMD group is
 * CUDA's warp): the SIMD groups take the sequence's keys in tiles of 32 in turn (keys 0..31, 32..63, ...), each key
 * found through the block table (slot = block_tables[seq, p / block_size] * block_size + p % block_size,
 * key_index below); inside one, lane j holds dims j, j+32, ... of q, k and v, and simd_sum adds the dot product
 * up onto every lane. All GROUP = n_heads / n_kv_heads query heads of the KV head are computed here, so each K/V
 * row is loaded once for GROUP heads. Each SIMD group keeps its own online softmax over its tiles (per tile of
 * scores s_1..s_n: m' = max(m, s_i); alpha = exp(m - m'); p_i = exp(s_i - m'); l' = alpha l + sum p_i;
 * acc' = alpha acc + sum p_i v_i), and the 4 are merged at the end through threadgroup memory:
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
 *     paged_attention_reduce, grid (n_heads, num_seqs): the row's partitions merged as the SIMD groups are,
 *                                               one level up:
 *                                               out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p
 *
 * A context of 8192 keys is then read by 16 x 3 blocks instead of 3, at the price of one more launch and the
 * partials' (n_heads x NUM_PARTS x (2 + head_dim)) floats per row written and read back.
 *
 * Arguments of paged_attention (row-major; TV_T is float or half, TV_CACHE_T float, half, char or uchar), buffers
 * 0-5 (0-7 when quantized: the scales come after v_cache):
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
 * Arguments of reshape_and_cache (grid: one threadgroup per token), buffers 0-4 (0-6 when quantized):
 *   k_cache, v_cache: (num_blocks, block_size, n_kv_heads, head_dim)   TV_CACHE_T, written at the given slots only
 *   k_scale, v_scale: (num_blocks, block_size, n_kv_heads)             float, int8 and fp8 only, the same slots
 *   key, value:       (num_tokens, n_kv_heads, head_dim)               TV_T, this step's new K and V
 *   slot_mapping:     (num_tokens,) int32   slot = block * block_size + offset; a negative slot is skipped
 * Compile-time constants: TV_NUM_SEQS, TV_NUM_HEADS, TV_NUM_KV_HEADS, TV_HEAD_DIM, TV_BLOCK_SIZE, TV_MAX_BLOCKS,
 * TV_SCALE, TV_NUM_THREADS; TV_NUM_TOKENS, TV_NUM_SLOTS; TV_T, TV_CACHE_T, TV_KV_QUANT; TV_KERNEL (kernel void).
 * One entry point per compilation, as on the CPU: TV_RESHAPE_AND_CACHE selects the write, TV_PAGED_ATTENTION_SPLIT
 * and TV_PAGED_ATTENTION_REDUCE (with TV_PARTITION_SIZE) flash-decoding's two kernels, otherwise the attention.
 *
 * Quantized caches (Phase 7c, docs/phases/07c-kv-cache-quantization.md; the layout of kernels/cpu/paged_attention.c):
 * TV_KV_QUANT 0 stores TV_CACHE_T as is; 1 int8 codes, x = code * scale; 2 fp8 e4m3 codes, x = e4m3(code) * scale,
 * with one float scale per token per KV head (amax / 127 or amax / 448), computed by the write as
 * tinyvllm/attention/kv_quant.py does. Metal has no fp8 type: e4m3 is converted by the CPU's bit arithmetic.
 */
#include <metal_stdlib>
using namespace metal;

#ifndef TV_SLIDING_WINDOW  /* a sliding-window layer's W (keys a query sees); 0: the whole context */
#define TV_SLIDING_WINDOW 0
#endif
#define WARP 32                                  /* threads per SIMD group on Apple GPUs (threadExecutionWidth) */
#define NUM_WARPS (TV_NUM_THREADS / WARP)
#define GROUP (TV_NUM_HEADS / TV_NUM_KV_HEADS)   /* query heads per KV head */
#define ROW (TV_NUM_KV_HEADS * TV_HEAD_DIM)      /* elements from one token's K (or V) row to the next token's */
#define TILE 32                                  /* keys per step of the online softmax (one rescale per tile) */
#define DIMS_PER_LANE ((TV_HEAD_DIM + WARP - 1) / WARP)
#define NEG_INF (-INFINITY)

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
inline uchar fp8_e4m3_encode(float y) {
  const float a = min(fabs(y), 448.0f);  /* saturate */
  const uint bits = as_type<uint>(a);
  const uint magnitude = a < 0.015625f ? uint(rint(a * 512.0f))  /* below 2^-6: subnormal, m * 2^-9 */
                                       : ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  return uchar(magnitude | ((as_type<uint>(y) >> 24) & 0x80u));
}

inline float fp8_e4m3_decode(uchar code) {
  const uint magnitude = code & 0x7Fu;
  const float value = magnitude < 8 ? float(magnitude) * 0.001953125f  /* subnormal: m * 2^-9 */
                                    : as_type<float>((magnitude << 20) + (120u << 23));
  return (code & 0x80u) ? -value : value;
}

/* one element of the cache as a float, before its row's scale */
inline float cache_to_float(TV_CACHE_T x) {
#if TV_KV_QUANT == KV_FP8
  return fp8_e4m3_decode(x);
#else
  return float(x);  /* float, half, or an int8 code */
#endif
}

/* flash-decoding's partials (paged_attention_split writes them, paged_attention_reduce merges them) */
#ifdef TV_PARTITION_SIZE
#define NUM_PARTS ((TV_MAX_BLOCKS * TV_BLOCK_SIZE + TV_PARTITION_SIZE - 1) / TV_PARTITION_SIZE)  /* per row, at most */
#define PARTIAL (2 + TV_HEAD_DIM)  /* floats per (row, head, partition): m, l, acc[head_dim] */
#endif

#ifdef TV_RESHAPE_AND_CACHE
/* ------------------------------------------------------------------------------------------------ the write */
#if TV_KV_QUANT
TV_KERNEL reshape_and_cache(device TV_CACHE_T* k_cache [[buffer(0)]], device TV_CACHE_T* v_cache [[buffer(1)]],
                            device float* k_scale [[buffer(2)]], device float* v_scale [[buffer(3)]],
                            const device TV_T* key [[buffer(4)]], const device TV_T* value [[buffer(5)]],
                            const device int* slot_mapping [[buffer(6)]],
                            uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  const int i = gid.x;
  const long slot = slot_mapping[i];
  if (slot < 0 || slot >= TV_NUM_SLOTS) return;  /* padding token (vLLM's -1), or no such slot */
  /* one thread per row to quantize: K or V of one KV head (2 x n_kv_heads threads busy; a token's write is small) */
  for (int r = lid.x; r < 2 * TV_NUM_KV_HEADS; r += TV_NUM_THREADS) {
    const int h = r % TV_NUM_KV_HEADS;
    const device TV_T* x = (r < TV_NUM_KV_HEADS ? key : value) + i * ROW + h * TV_HEAD_DIM;
    device TV_CACHE_T* dst = (r < TV_NUM_KV_HEADS ? k_cache : v_cache) + slot * ROW + h * TV_HEAD_DIM;
    float amax = 0.0f;
    for (int d = 0; d < TV_HEAD_DIM; d++) amax = max(amax, fabs(float(x[d])));
    (r < TV_NUM_KV_HEADS ? k_scale : v_scale)[slot * TV_NUM_KV_HEADS + h] = amax * (1.0f / QMAX);
    const float inv = amax > 0.0f ? QMAX / amax : 0.0f;  /* as tinygrad: one division, then x * inv */
    for (int d = 0; d < TV_HEAD_DIM; d++) {
#if TV_KV_QUANT == KV_INT8
      dst[d] = TV_CACHE_T(rint(float(x[d]) * inv));  /* round half to even, |code| <= 127 */
#else
      dst[d] = fp8_e4m3_encode(float(x[d]) * inv);
#endif
    }
  }
}
#else
TV_KERNEL reshape_and_cache(device TV_CACHE_T* k_cache [[buffer(0)]], device TV_CACHE_T* v_cache [[buffer(1)]],
                            const device TV_T* key [[buffer(2)]], const device TV_T* value [[buffer(3)]],
                            const device int* slot_mapping [[buffer(4)]],
                            uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  const int i = gid.x;
  const long slot = slot_mapping[i];
  if (slot < 0 || slot >= TV_NUM_SLOTS) return;  /* padding token (vLLM's -1), or no such slot */
  for (int j = lid.x; j < ROW; j += TV_NUM_THREADS) {
    k_cache[slot * ROW + j] = TV_CACHE_T(float(key[i * ROW + j]));
    v_cache[slot * ROW + j] = TV_CACHE_T(float(value[i * ROW + j]));
  }
}
#endif

#elif defined(TV_PAGED_ATTENTION_REDUCE)
/* ------------------------------------------------------------------------------- flash-decoding's merge */
/* grid (n_heads, num_seqs): out[seq, head] from the row's partitions that hold keys, merged as the SIMD groups are:
 * out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p, M = max_p m_p. One thread per element of head_dim. */
TV_KERNEL paged_attention_reduce(device TV_T* out [[buffer(0)]], const device float* partials [[buffer(1)]],
                                 const device int* context_lens [[buffer(2)]],
                                 uint3 gid [[threadgroup_position_in_grid]],
                                 uint3 lid [[thread_position_in_threadgroup]]) {
  const int head = gid.x, seq = gid.y;
  const int num_keys = min(context_lens[seq], TV_MAX_BLOCKS * TV_BLOCK_SIZE);
  const int parts = (num_keys + TV_PARTITION_SIZE - 1) / TV_PARTITION_SIZE;
  /* (NUM_PARTS, PARTIAL) */
  const device float* row = partials + (long)(seq * TV_NUM_HEADS + head) * NUM_PARTS * PARTIAL;
  for (int d = lid.x; d < TV_HEAD_DIM; d += TV_NUM_THREADS) {
    float big_m = NEG_INF;
    for (int p = 0; p < parts; p++) big_m = max(big_m, row[p * PARTIAL]);
    float num = 0.0f, den = 0.0f;
    for (int p = 0; p < parts; p++) {
      const float m = row[p * PARTIAL];
      const float scale = m == NEG_INF ? 0.0f : precise::exp(m - big_m);
      num += scale * row[p * PARTIAL + 2 + d];
      den += scale * row[p * PARTIAL + 1];
    }
    out[(seq * TV_NUM_HEADS + head) * TV_HEAD_DIM + d] = TV_T(den > 0.0f ? num / den : 0.0f);
  }
}

#else
/* -------------------------------------------------------------------------------------------- the attention */
/* where token p of a sequence keeps its K (or V) for one KV head: slot = table[p / block_size] * block_size
 * + p % block_size, then (slot, kv_head): its scale's index, and times head_dim its row's first element.
 * A tile of keys spans several blocks when block_size < TILE. */
inline long key_index(const device int* table, int p, int kv_head) {
  return ((long)table[p / TV_BLOCK_SIZE] * TV_BLOCK_SIZE + p % TV_BLOCK_SIZE) * TV_NUM_KV_HEADS + kv_head;
}

#if TV_KV_QUANT
#define ROW_SCALE(scales, index) ((scales)[index])
#define SCALE_BUFFERS const device float* k_scale [[buffer(4)]], const device float* v_scale [[buffer(5)]],
#define TABLE_BUFFER 6
#else
#define ROW_SCALE(scales, index) 1.0f
#define SCALE_BUFFERS
#define TABLE_BUFFER 4
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

TV_KERNEL ENTRY(device OUT_T* out [[buffer(0)]], const device TV_T* q [[buffer(1)]],
                const device TV_CACHE_T* k_cache [[buffer(2)]], const device TV_CACHE_T* v_cache [[buffer(3)]],
                SCALE_BUFFERS
                const device int* block_tables [[buffer(TABLE_BUFFER)]],
                const device int* context_lens [[buffer(TABLE_BUFFER + 1)]],
                uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
#ifdef TV_PAGED_ATTENTION_SPLIT
  const int kv_head = gid.x % TV_NUM_KV_HEADS, part = gid.x / TV_NUM_KV_HEADS, seq = gid.y;
#else
  const int kv_head = gid.x, seq = gid.y;
#endif
  const int warp = lid.x / WARP, lane = lid.x % WARP;
  const int context_len = context_lens[seq];
  const device int* table = block_tables + seq * TV_MAX_BLOCKS;
  const device TV_T* q_group = q + (seq * TV_NUM_HEADS + kv_head * GROUP) * TV_HEAD_DIM;  /* (GROUP, head_dim) */

  threadgroup float scores[NUM_WARPS][GROUP][TILE];  /* each SIMD group's scores, then p, for its tile */
  threadgroup float warp_m[NUM_WARPS][GROUP], warp_l[NUM_WARPS][GROUP];
  threadgroup float warp_acc[NUM_WARPS][GROUP][TV_HEAD_DIM];

  float qr[GROUP][DIMS_PER_LANE], acc[GROUP][DIMS_PER_LANE], m[GROUP], l[GROUP];
  for (int g = 0; g < GROUP; g++) {
    m[g] = NEG_INF;
    l[g] = 0.0f;
    for (int i = 0; i < DIMS_PER_LANE; i++) {
      const int d = lane + i * WARP;
      qr[g][i] = d < TV_HEAD_DIM ? float(q_group[g * TV_HEAD_DIM + d]) : 0.0f;
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
  /* the SIMD groups take tiles of keys in turn */
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
        dot = simd_sum(dot);
        if (lane == 0) scores[warp][g][t] = dot * score_scale;
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    /* 2. online softmax over this tile: new max, rescale the sums so far by alpha, p = exp(s - m') */
    for (int g = 0; g < GROUP; g++) {
      float m_new = m[g];
      for (int t = 0; t < n; t++) m_new = max(m_new, scores[warp][g][t]);
      const float alpha = precise::exp(m[g] - m_new);  /* exp(-inf) = 0 on the SIMD group's first tile */
      simdgroup_barrier(mem_flags::mem_threadgroup);  /* every lane has read the scores before they are overwritten */
      for (int t = lane; t < n; t += WARP) scores[warp][g][t] = precise::exp(scores[warp][g][t] - m_new);  /* now p */
      simdgroup_barrier(mem_flags::mem_threadgroup);
      float sum = 0.0f;
      for (int t = 0; t < n; t++) sum += scores[warp][g][t];
      m[g] = m_new;
      l[g] = l[g] * alpha + sum;
      for (int i = 0; i < DIMS_PER_LANE; i++) acc[g][i] *= alpha;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
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
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }

  /* merge the SIMD groups: out = sum_w exp(m_w - M) acc_w / sum_w exp(m_w - M) l_w, M = max_w m_w */
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
  threadgroup_barrier(mem_flags::mem_threadgroup);
#ifndef TV_PAGED_ATTENTION_SPLIT
  device TV_T* out_group = out + (seq * TV_NUM_HEADS + kv_head * GROUP) * TV_HEAD_DIM;
#endif
  for (int j = lid.x; j < GROUP * TV_HEAD_DIM; j += TV_NUM_THREADS) {
    const int g = j / TV_HEAD_DIM, d = j % TV_HEAD_DIM;
    float big_m = NEG_INF;
    for (int w = 0; w < NUM_WARPS; w++) big_m = max(big_m, warp_m[w][g]);
    float num = 0.0f, den = 0.0f;
    for (int w = 0; w < NUM_WARPS; w++) {
      const float scale = warp_m[w][g] == NEG_INF ? 0.0f : precise::exp(warp_m[w][g] - big_m);  /* no tile */
      num += scale * warp_acc[w][g][d];
      den += scale * warp_l[w][g];
    }
#ifdef TV_PAGED_ATTENTION_SPLIT
    device float* partial = out + ((long)(seq * TV_NUM_HEADS + kv_head * GROUP + g) * NUM_PARTS + part) * PARTIAL;
    if (d == 0) {
      partial[0] = big_m;  /* -inf, with l = 0 and acc = 0, for a partition past the row's context */
      partial[1] = den;
    }
    partial[2 + d] = num;
#else
    out_group[j] = TV_T(den > 0.0f ? num / den : 0.0f);  /* an empty context gives zeros */
#endif
  }
}
#endif
