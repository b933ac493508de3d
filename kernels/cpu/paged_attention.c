/* Paged attention for decoding, and the write that fills the KV cache: the CPU twin of kernels/cuda/paged_attention.cu
 * and kernels/metal/paged_attention.metal (same arguments, same algorithm; see docs/phases/05-custom-kernels.md).
 *
 * Why a hand-written kernel: the portable path (tinyvllm/attention/paged.py) gathers every row's blocks into a
 * contiguous copy, builds a causal mask, then runs QK^T, softmax and PV as separate kernels. Per layer and decode
 * step that is 10 kernels (2 cache writes, mask, 2 gathers, scores, 3 softmax, PV), and the K/V bytes go through
 * memory three times: read from the blocks, written as the copy, read back by the matmuls. For the default model
 * (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32) one token of context holds
 *     K + V = 2 x 3 x 64 x 4 B = 1,536 B per layer,  x 30 layers = 46 KB per token of context,
 * so one sequence decoding at context 2048 keeps 94 MB of K/V; the gather moves ~3 x 94 = 283 MB per step
 * (about half the 538 MB of weights a step reads), this kernel reads the 94 MB once, in place, through the block
 * table. And 10 launches per layer become 2 (this file's two entry points): 300 -> 60 per step.
 *
 * What one chunk of work does (a "thread block" on a GPU): one sequence x one KV head, all GROUP = NUM_HEADS /
 * NUM_KV_HEADS query heads that share it (grouped-query attention), so each K/V row comes from memory once for
 * GROUP heads (a tile's rows stay in L1 from one head to the next).
 * It walks the sequence's keys in tiles of 32, each key found through the block table (key p is in slot
 * block_tables[seq, p / block_size] * block_size + p % block_size), and keeps a running softmax (online softmax,
 * one pass over K/V):
 *     m = max score so far, l = sum of exp(score - m) so far, acc = sum of exp(score - m) * v so far
 * and per tile of keys with scores s_1..s_n:
 *     m' = max(m, s_1..s_n);  alpha = exp(m - m');  p_i = exp(s_i - m')
 *     l' = alpha * l + sum p_i;  acc' = alpha * acc + sum p_i * v_i;  at the end: out = acc / l
 * The rows of a prompt chunk read the same keys: up to 16 / GROUP of them walk those keys in one pass instead,
 * one query head per vector lane (attend_rows, below), with the same bits per row as alone.
 * Chunks (groups of rows x n_kv_heads) are spread over both cores by the thread pool (threadpool.h) when the
 * launch reads enough K/V to be worth it.
 *
 * Arguments of paged_attention (all row-major; q and out float32, the caches cache_t; int32 tables):
 *   out:          (num_seqs, n_heads, head_dim)              written: attention output of each row's one query
 *   q:            (num_seqs, n_heads, head_dim)              one query token per row (decode; or one token of a
 *                                                            flattened prompt chunk: its own row, its own context)
 *   k_cache:      (num_blocks, block_size, n_kv_heads, head_dim)
 *   v_cache:      (num_blocks, block_size, n_kv_heads, head_dim)
 *   k_scale:      (num_blocks, block_size, n_kv_heads)   float32, int8 and fp8 caches only: one scale per token
 *   v_scale:      (num_blocks, block_size, n_kv_heads)   float32   per KV head (key p's K is k_cache[...] * k_scale[...])
 *   block_tables: (num_seqs, max_blocks)   int32             row i: the physical blocks of row i's sequence, in order
 *   context_lens: (num_seqs,)              int32             row i attends to its keys 0 .. context_lens[i]-1
 * Arguments of reshape_and_cache:
 *   k_cache, v_cache: (num_blocks, block_size, n_kv_heads, head_dim)   written at the given slots only
 *   k_scale, v_scale: (num_blocks, block_size, n_kv_heads)             int8 and fp8 only, written at the same slots
 *   key, value:       (num_tokens, n_kv_heads, head_dim)               float32, this step's new K and V
 *   slot_mapping:     (num_tokens,) int32   slot = block * block_size + offset; a negative slot is skipped
 *
 * Sizes are compile-time constants: TV_NUM_SEQS, TV_NUM_HEADS, TV_NUM_KV_HEADS, TV_HEAD_DIM, TV_BLOCK_SIZE,
 * TV_MAX_BLOCKS, TV_SCALE (1/sqrt(head_dim)) for paged_attention; TV_NUM_TOKENS, TV_NUM_SLOTS for reshape_and_cache.
 * The context lengths are data, read at run time: one compiled program serves every context length.
 * TV_SLIDING_WINDOW (0: none) is a sliding-window layer's W (Mistral, Gemma 3): row i reads only its last W keys,
 * context_lens[i]-W .. context_lens[i]-1, so the blocks wholly before them are never touched.
 *
 * The cache's element (Phase 7c, docs/phases/07c-kv-cache-quantization.md): TV_CACHE_T is float, __fp16,
 * signed char or unsigned char, and TV_KV_QUANT says what the bytes mean: 0 a float as is, 1 int8 codes
 * (x = code * scale), 2 fp8 e4m3 codes (x = e4m3(code) * scale). The write quantizes exactly as the portable
 * path does (tinyvllm/attention/kv_quant.py), bit for bit. The attention first turns each tile's 32 K and V rows
 * back into float32, scale applied, in a buffer on the stack (L1), then runs the float32 code below unchanged:
 * one conversion per element per launch, shared by the GROUP query heads, while memory delivers a quarter of
 * float32's bytes (64 codes + a 4-byte scale per row instead of 256 bytes).
 *
 * tinygrad's CPU runtime calls the first byte of the compiled object, so a compilation can have only one entry point:
 * TV_RESHAPE_AND_CACHE selects the write, otherwise it is the attention (the GPU files do the same, to keep one
 * layout; there each program's constants only fit one of the two anyway).
 */
#include "threadpool.h"
#include "exp_poly.h"

#if TV_HEAD_DIM % 8 != 0
#error "paged_attention.c needs head_dim to be a multiple of 8 (one AVX2 register of floats)"
#endif

#define HD8 (TV_HEAD_DIM / 8)  /* head_dim in 8-float vectors */

/* 8 floats in one AVX2 register; aligned(4) makes loads through a pointer to it unaligned loads */
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int i8 __attribute__((vector_size(32), aligned(4)));

#ifndef TV_SLIDING_WINDOW
#define TV_SLIDING_WINDOW 0
#endif

#ifndef TV_CACHE_T  /* a float32 cache, as before Phase 7c */
#define TV_CACHE_T float
#define TV_CACHE_BITS 32
#define TV_KV_QUANT 0
#endif
typedef TV_CACHE_T cache_t;
#define KV_INT8 1
#define KV_FP8 2
#if TV_KV_QUANT == KV_INT8
#define QMAX 127.0f
#elif TV_KV_QUANT == KV_FP8
#define QMAX 448.0f
#endif

/* ------------------------------------------------------------------------ fp8 e4m3 <-> float32, bit by bit */
/* e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; normals 2^(e-7) * (1 + m/8), subnormals m * 2^-9,
 * largest 448 (0x7E). The same integer steps as fp8_e4m3_encode / fp8_e4m3_decode in kv_quant.py. */
TV_INLINE unsigned float_bits(float x) { union { float f; unsigned u; } v = {x}; return v.u; }
TV_INLINE float bits_float(unsigned u) { union { unsigned u; float f; } v = {u}; return v.f; }

TV_INLINE unsigned char fp8_e4m3_encode(float y) {
  float a = __builtin_fabsf(y);
  a = a < 448.0f ? a : 448.0f;  /* saturate (and a NaN becomes 448) */
  const unsigned bits = float_bits(a);
  const unsigned magnitude = a < 0x1p-6f ? (unsigned)__builtin_rintf(a * 512.0f)  /* subnormal: m * 2^-9 */
                                         : ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  return (unsigned char)(magnitude | ((float_bits(y) >> 24) & 0x80u));
}

/* 8 codes -> 8 floats: e + 120 into a float32's exponent, except the subnormals (m * 2^-9), then the sign */
typedef unsigned char u8x8 __attribute__((vector_size(8), aligned(1)));
typedef unsigned u8 __attribute__((vector_size(32), aligned(4)));
TV_INLINE f8 fp8_e4m3_decode8(u8x8 codes) {
  const u8 c = __builtin_convertvector(codes, u8);  /* zero-extended */
  const u8 magnitude = c & 0x7F;
  const u8 normal = (magnitude << 20) + (120u << 23);
  const u8 subnormal = (u8)(__builtin_convertvector(magnitude, f8) * 0x1p-9f);
  const u8 is_sub = (u8)(magnitude < 8);  /* all ones where subnormal */
  return (f8)((is_sub & subnormal) | (~is_sub & normal) | ((c & 0x80) << 24));
}

/* one token's K (or V) row for one KV head, head_dim floats, -> cache_t (and its scale when quantized) */
TV_INLINE void store_row(cache_t* restrict dst, float* restrict scale, const float* restrict x) {
#if TV_KV_QUANT
  float amax = 0.0f;
  for (int j = 0; j < TV_HEAD_DIM; j++) amax = __builtin_fmaxf(amax, __builtin_fabsf(x[j]));
  /* as tinygrad computes them (one division for inv, then x * inv): bit-equal codes */
  *scale = amax * (1.0f / QMAX);
  const float inv = amax > 0.0f ? QMAX / amax : 0.0f;
  for (int j = 0; j < TV_HEAD_DIM; j++) {
#if TV_KV_QUANT == KV_INT8
    dst[j] = (cache_t)__builtin_rintf(x[j] * inv);  /* round half to even, |code| <= 127 */
#else
    dst[j] = fp8_e4m3_encode(x[j] * inv);
#endif
  }
#else
  (void)scale;
  for (int j = 0; j < TV_HEAD_DIM; j++) dst[j] = (cache_t)x[j];  /* float16: round to nearest even */
#endif
}

/* one cached row back to float32: head_dim elements of cache_t, times the row's scale */
#if TV_KV_QUANT == KV_INT8
typedef signed char s8x8 __attribute__((vector_size(8), aligned(1)));
#define LOAD8(p) __builtin_convertvector(*(const s8x8*)(p), f8)
#elif TV_KV_QUANT == KV_FP8
#define LOAD8(p) fp8_e4m3_decode8(*(const u8x8*)(p))
#else
typedef cache_t c8 __attribute__((vector_size(8 * sizeof(cache_t)), aligned(sizeof(cache_t))));
#define LOAD8(p) __builtin_convertvector(*(const c8*)(p), f8)
#endif
TV_INLINE void load_row(float* restrict dst, const cache_t* restrict src, float scale) {
  for (int d = 0; d < HD8; d++) {
#if TV_KV_QUANT
    *(f8*)(dst + 8 * d) = LOAD8(src + 8 * d) * scale;
#else
    (void)scale;
    *(f8*)(dst + 8 * d) = LOAD8(src + 8 * d);
#endif
  }
}

#ifdef TV_RESHAPE_AND_CACHE

/* ------------------------------------------------------------------------------------------------ the write */
TV_KERNEL reshape_and_cache(cache_t* restrict k_cache, cache_t* restrict v_cache,
#if TV_KV_QUANT
                            float* restrict k_scale, float* restrict v_scale,
#endif
                            const float* restrict key, const float* restrict value,
                            const int* restrict slot_mapping) {
  /* (num_tokens x 2 rows of n_kv_heads * head_dim floats: 1.5 KB per token here; too little to share out) */
  const int row = TV_NUM_KV_HEADS * TV_HEAD_DIM;
  for (int i = 0; i < TV_NUM_TOKENS; i++) {
    int slot = slot_mapping[i];
    if (slot < 0 || slot >= TV_NUM_SLOTS) continue;  /* padding token (vLLM's -1), or no such slot */
    for (int h = 0; h < TV_NUM_KV_HEADS; h++) {
      const long at = (long)slot * TV_NUM_KV_HEADS + h;  /* (slot, kv head): the scale's index */
#if TV_KV_QUANT
      store_row(k_cache + at * TV_HEAD_DIM, k_scale + at, key + i * row + h * TV_HEAD_DIM);
      store_row(v_cache + at * TV_HEAD_DIM, v_scale + at, value + i * row + h * TV_HEAD_DIM);
#else
      store_row(k_cache + at * TV_HEAD_DIM, 0, key + i * row + h * TV_HEAD_DIM);
      store_row(v_cache + at * TV_HEAD_DIM, 0, value + i * row + h * TV_HEAD_DIM);
#endif
    }
  }
}

#else

/* -------------------------------------------------------------------------------------------- the attention */
#define GROUP (TV_NUM_HEADS / TV_NUM_KV_HEADS)  /* query heads per KV head */
#define ROW (TV_NUM_KV_HEADS * TV_HEAD_DIM)     /* floats from one token's K (or V) row to the next token's */
#define TILE 32                                 /* keys per step of the online softmax (one rescale per tile) */
#define PARALLEL_MIN_BYTES (4L << 20)             /* K/V bytes a launch must read before it uses the thread pool */

/* Rows that read the same keys (the tokens of one prompt chunk: each its own row, with the same block table and
 * context lengths one apart) are attended together, up to ROWS_TOGETHER rows: LANES query heads, one per lane of a
 * vector register (see attend_rows). A row alone (decoding) takes attend_chunk. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define ROWS_TOGETHER (TV_SLIDING_WINDOW == 0 ? LANES / GROUP : 1)  /* a window's tiles start row by row: alone */

struct attention_args {
  float* out;
  const float* q;
  const cache_t* k_cache;
  const cache_t* v_cache;
  const float* k_scale;  /* NULL unless quantized */
  const float* v_scale;
  const int* block_tables;
  const int* context_lens;
  const int* first_rows;  /* group i is rows first_rows[i] .. first_rows[i+1]-1 */
};

static void attend_group(const void* ctx, int chunk);

/* keys row `r` reads: its context, at most what its block table holds */
TV_INLINE int num_keys_of(const int* context_lens, int r) {
  return context_lens[r] < TV_MAX_BLOCKS * TV_BLOCK_SIZE ? context_lens[r] : TV_MAX_BLOCKS * TV_BLOCK_SIZE;
}

/* can row r join the group that row `first` starts? Its keys must be the first row's: the same blocks wherever
 * either reads, and close enough in number that the longer row's last tile is not mostly masked for the other */
TV_INLINE int reads_same_keys(const int* block_tables, const int* context_lens, int first, int r) {
  const int a = num_keys_of(context_lens, first), b = num_keys_of(context_lens, r);
  if (b - a >= TILE || a - b >= TILE) return 0;
  const int blocks = ((a > b ? a : b) + TV_BLOCK_SIZE - 1) / TV_BLOCK_SIZE;
  for (int i = 0; i < blocks; i++)
    if (block_tables[first * TV_MAX_BLOCKS + i] != block_tables[r * TV_MAX_BLOCKS + i]) return 0;
  return 1;
}

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL paged_attention(float* restrict out, const float* restrict q, const cache_t* restrict k_cache,
                          const cache_t* restrict v_cache,
#if TV_KV_QUANT
                          const float* restrict k_scale, const float* restrict v_scale,
#endif
                          const int* restrict block_tables, const int* restrict context_lens) {
  int first_rows[TV_NUM_SEQS + 1];
  int groups = 0;
  for (int r = 0; r < TV_NUM_SEQS;) {  /* consecutive rows over the same keys form a group */
    int end = r + 1;
    while (end < TV_NUM_SEQS && end - r < ROWS_TOGETHER && reads_same_keys(block_tables, context_lens, r, end)) end++;
    first_rows[groups++] = r;
    r = end;
  }
  first_rows[groups] = TV_NUM_SEQS;
#if TV_KV_QUANT
  struct attention_args args = {out, q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, first_rows};
#else
  struct attention_args args = {out, q, k_cache, v_cache, 0, 0, block_tables, context_lens, first_rows};
#endif
  /* a small job runs on this thread alone: on a busy machine, waking a parked helper (or waiting for one the OS
   * paused mid-chunk) can take longer than the whole job, such as one sequence's 512-token context (2.4 MB of
   * K/V at batch 1, 3 KV heads): below the byte count checked here, the job stays on this thread. A group reads
   * its keys once for all its rows. */
  long bytes = 0;
  for (int i = 0; i < groups; i++) {
    /* A row alone reads its K/V once for its GROUP heads, and takes about as long as the reading; a group of rows
     * (a prompt chunk, or one sequence verifying its drafts) computes a score and an accumulation per key for each
     * of its rows x GROUP heads: it counts as that many reads of its keys */
    const int rows = first_rows[i + 1] - first_rows[i];
    const long keys_bytes = (long)context_lens[first_rows[i + 1] - 1] * 2 * ROW * (long)sizeof(cache_t);
    bytes += keys_bytes * (rows > 1 ? rows * GROUP : 1);
  }
  if (bytes < PARALLEL_MIN_BYTES) {
    for (int c = 0; c < groups * TV_NUM_KV_HEADS; c++) attend_group(&args, c);
  } else {
    tv_parallel_for(attend_group, &args, groups * TV_NUM_KV_HEADS);
  }
}

TV_INLINE float hsum8(f8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* q . k for the 8 keys rows[0..7] at once, as one vector of 8 scores. Each dot product is first a vector of 8
 * partial sums; a transposed add tree then folds the 8 vectors into one (3 levels of 2 shuffles and an add each,
 * 7 adds in all) instead of one horizontal sum per key. */
TV_INLINE f8 dot8(const f8* q, const float* const* rows) {
  f8 d[8];
  for (int j = 0; j < 8; j++) {
    const f8* k = (const f8*)rows[j];
    f8 acc = q[0] * k[0];
    for (int i = 1; i < HD8; i++) acc += q[i] * k[i];
    d[j] = acc;
  }
  f8 e[4], f[2];
  for (int j = 0; j < 4; j++)  /* e[j]: 4 partial sums of d[2j] (lanes 0,1,4,5) and of d[2j+1] (lanes 2,3,6,7) */
    e[j] = __builtin_shufflevector(d[2 * j], d[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(d[2 * j], d[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  for (int j = 0; j < 2; j++)  /* f[j]: lanes 0-3 the low-half sums of d[4j..4j+3], lanes 4-7 the high-half sums */
    f[j] = __builtin_shufflevector(e[2 * j], e[2 * j + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(e[2 * j], e[2 * j + 1], 1, 3, 9, 11, 5, 7, 13, 15);
  return __builtin_shufflevector(f[0], f[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(f[0], f[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* exp(x) for 8 floats without libc, as Cephes' expf (exp_poly.h): x = n*ln2 + r with |r| <= ln2/2, exp(r) by a
 * polynomial, 2^n put straight into the exponent bits.
 * x is clamped to [-87.3, 88.3], where 2^n stays a normal float: exp(-inf) comes out as ~1e-38, not 0, which
 * only ever multiplies an accumulator that is still 0. */
/* written once for any vector width (T floats, IT ints): the grouped route below evaluates the same operations on
 * LANES lanes, so every lane gets the bits exp8 would give it */
#define TV_EXP_CLAMPED(T, IT, x_in)                                                      \
  ({                                                                                     \
    const T magic_ = (T){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, kept in the low bits */ \
    T x_ = __builtin_elementwise_min(__builtin_elementwise_max((x_in), (T){0} - 87.3f), (T){0} + 88.3f);        \
    T t_ = x_ * 1.44269504f + magic_;                                                    \
    T n_ = t_ - magic_;                                          /* round(x / ln2) */    \
    T e_ = TV_EXP_REDUCED(T, x_, n_);                            /* exp(x - n*ln2) */    \
    IT bits_ = ((IT)t_ - (IT)magic_ + 127) << 23;                /* 2^n as a float's bits */ \
    e_ * (T)bits_;                                                                       \
  })

TV_INLINE f8 exp8(f8 x) { return TV_EXP_CLAMPED(f8, i8, x); }

TV_INLINE float exp1(float x) { return exp8((f8){0} + x)[0]; }

/* Key p of a sequence (its block table `table`) for one KV head: the index of its (slot, kv head) row, slot =
 * table[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE; its K is at k_cache + row * HEAD_DIM, its scale k_scale[row]. */
TV_INLINE long key_row(const int* table, int p, int kv_head) {
  return ((long)table[p / TV_BLOCK_SIZE] * TV_BLOCK_SIZE + p % TV_BLOCK_SIZE) * TV_NUM_KV_HEADS + kv_head;
}

/* The K and V rows of keys t0 .. t0+n-1 (n <= TILE) of one KV head (a tile spans several blocks when block_size <
 * TILE).
 * float32 rows are read in place; other caches are turned into float32 in k_tile / v_tile first, scale applied,
 * once for every query head that reads them. Rows past n point at a valid row: whatever they give is never used. */
TV_INLINE void tile_rows(const struct attention_args* a, const int* table, int kv_head, int t0, int n,
                         const float** k_rows, const float** v_rows, float (*k_tile)[TV_HEAD_DIM],
                         float (*v_tile)[TV_HEAD_DIM]) {
  for (int t = 0; t < TILE; t++) {
    const long at = key_row(table, t0 + (t < n ? t : 0), kv_head);
#if TV_CACHE_BITS == 32
    (void)k_tile, (void)v_tile;
    k_rows[t] = a->k_cache + at * TV_HEAD_DIM;  /* float32: read in place */
    v_rows[t] = a->v_cache + at * TV_HEAD_DIM;
#else
    if (t < n) {  /* dequantize (or widen) once for all the heads */
      load_row(k_tile[t], a->k_cache + at * TV_HEAD_DIM, TV_KV_QUANT ? a->k_scale[at] : 1.0f);
      load_row(v_tile[t], a->v_cache + at * TV_HEAD_DIM, TV_KV_QUANT ? a->v_scale[at] : 1.0f);
    }
    k_rows[t] = k_tile[t < n ? t : 0];
    v_rows[t] = v_tile[t < n ? t : 0];
#endif
  }
}

/* Ask for the K and V rows of keys t0 .. num_keys-1 (at most a tile) to come into cache while the current tile
 * is worked on: a sequence's blocks lie anywhere in the pool, so the hardware prefetcher, which follows addresses
 * within a page, misses the first rows of every block. */
TV_INLINE void prefetch_tile(const struct attention_args* a, const int* table, int kv_head, int t0, int num_keys) {
  const int n = num_keys - t0 < TILE ? num_keys - t0 : TILE;
  for (int t = 0; t < n; t++) {
    const long at = key_row(table, t0 + t, kv_head);
    for (int c = 0; c < TV_HEAD_DIM * (int)sizeof(cache_t); c += 64) {
      __builtin_prefetch((const char*)(a->k_cache + at * TV_HEAD_DIM) + c, 0, 3);
      __builtin_prefetch((const char*)(a->v_cache + at * TV_HEAD_DIM) + c, 0, 3);
    }
  }
}

/* One sequence x one KV head: its GROUP query heads over the sequence's keys, a tile of 32 at a time. Per head,
 * the scores of 8 keys come out of dot8 as one vector, and the head's accumulator (HD8 vectors) stays in
 * registers while the tile's V rows are added in (several times faster at batch 32 x 8192 tokens than one
 * horizontal sum per score with all GROUP accumulators live at once, 24 vectors for 16 registers). */
static void attend_chunk(const struct attention_args* a, int seq, int kv_head) {
  const int* table = a->block_tables + seq * TV_MAX_BLOCKS;
  const f8* q = (const f8*)(a->q + (seq * TV_NUM_HEADS + kv_head * GROUP) * TV_HEAD_DIM);  /* (GROUP, HD8) */
  float* out = a->out + (seq * TV_NUM_HEADS + kv_head * GROUP) * TV_HEAD_DIM;                /* (GROUP, head_dim) */

  f8 acc[GROUP][HD8];  /* running sum of p * v, per query head */
  float m[GROUP], l[GROUP];  /* running max score, running sum of p */
  for (int g = 0; g < GROUP; g++) {
    m[g] = -3.0e38f;
    l[g] = 0.0f;
    for (int d = 0; d < HD8; d++) acc[g][d] = (f8){0};
  }
  const int num_keys = num_keys_of(a->context_lens, seq);
#if TV_CACHE_BITS != 32
  float k_tile[TILE][TV_HEAD_DIM] __attribute__((aligned(32)));  /* this tile's rows in float32, scale applied */
  float v_tile[TILE][TV_HEAD_DIM] __attribute__((aligned(32)));
#else
  float (*k_tile)[TV_HEAD_DIM] = 0, (*v_tile)[TV_HEAD_DIM] = 0;
#endif
  /* a sliding window starts the walk at the window's first key: the keys (and blocks) before it are skipped */
  const int first_key = TV_SLIDING_WINDOW > 0 && num_keys > TV_SLIDING_WINDOW ? num_keys - TV_SLIDING_WINDOW : 0;
  for (int t0 = first_key; t0 < num_keys; t0 += TILE) {
    const int n = num_keys - t0 < TILE ? num_keys - t0 : TILE;
    const float* k_rows[TILE];
    const float* v_rows[TILE];
    tile_rows(a, table, kv_head, t0, n, k_rows, v_rows, k_tile, v_tile);
    prefetch_tile(a, table, kv_head, t0 + TILE, num_keys);
    const i8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int g = 0; g < GROUP; g++) {  /* the tile's K and V rows stay in L1 from one query head to the next */
      /* 1. scores s[t] = q_g . k_t * scale, 8 keys at a time */
      float s[TILE] __attribute__((aligned(32)));
      for (int t = 0; t < n; t += 8) *(f8*)&s[t] = dot8(q + g * HD8, k_rows + t) * TV_SCALE;
      /* 2. online softmax: new max, rescale what was summed so far by alpha = exp(m_old - m_new), add this tile */
      float m_new = m[g];
      for (int t = 0; t < n; t++) m_new = s[t] > m_new ? s[t] : m_new;
      const float alpha = exp1(m[g] - m_new);
      f8 sum = (f8){0};
      for (int t = 0; t < n; t += 8) {
        f8 p = exp8(*(const f8*)&s[t] - m_new);
        p = (f8)((i8)p & (lane < n - t));  /* keys past the end of the sequence weigh 0 */
        *(f8*)&s[t] = p;                   /* s now holds p = exp(s - m_new) */
        sum += p;
      }
      m[g] = m_new;
      l[g] = l[g] * alpha + hsum8(sum);
      /* 3. acc = alpha * acc + sum_t p_t * v_t, in registers for this head */
      f8 o[HD8];
      for (int d = 0; d < HD8; d++) o[d] = acc[g][d] * alpha;
      for (int t = 0; t < n; t++) {
        const f8* v = (const f8*)v_rows[t];
        for (int d = 0; d < HD8; d++) o[d] += s[t] * v[d];
      }
      for (int d = 0; d < HD8; d++) acc[g][d] = o[d];
    }
  }
  for (int g = 0; g < GROUP; g++) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  /* an empty context (no keys) gives zeros */
    for (int d = 0; d < HD8; d++) *(f8*)(out + g * TV_HEAD_DIM + d * 8) = acc[g][d] * inv;
  }
}

/* ------------------------------------------------------------------------- several rows over the same keys */
/* A prompt chunk's tokens are rows that read the same keys, each a few more than the last. attend_chunk would
 * walk those keys once per row; here up to ROWS_TOGETHER rows walk them once, their GROUP heads each in one lane
 * of a LANES-float vector (lane = row * GROUP + head), so every operation serves all the query heads at once:
 *   - a score for key t is a vector: the lanes' q (held transposed, qt[dim][lane]) times K[t][dim], each K
 *     element read once and broadcast to every lane;
 *   - the online softmax's m, l and alpha are vectors, one lane per query head;
 *   - the accumulator is held transposed too, acc[dim][lane], and V[t][dim] broadcast into it.
 * No horizontal sums, no shuffles. Each lane's keys end at its own context: keys past it are masked (p = 0, out
 * of the max), and a lane with no key in a tile keeps its m, l and acc unchanged (alpha = 1).
 * The same bits as attend_chunk, lane for lane: each lane does attend_chunk's float operations in its order
 * (dot8's eight partial sums, dims j, j+8, ..., j+56, and its add tree; the same exp; p summed 8 keys apart and
 * then by hsum8's tree; l = l * alpha + sum; acc = acc * alpha then + p_t v_t key by key). Adding a masked key's
 * p = 0 changes no bits, so whichever rows share a group, a row's output is the one it would get alone. */
typedef float fl __attribute__((vector_size(4 * LANES), aligned(4)));
typedef int il __attribute__((vector_size(4 * LANES), aligned(4)));

TV_INLINE fl expl(fl x) { return TV_EXP_CLAMPED(fl, il, x); }
TV_INLINE fl select_fl(il mask, fl yes, fl no) { return (fl)((mask & (il)yes) | (~mask & (il)no)); }

/* a key's score from its eight partial sums p[j] (dims j, j+8, .., j+56), added as dot8's transposed tree adds
 * them: low half (0+2)+(1+3), high half (4+6)+(5+7), then low + high */
TV_INLINE fl dot8_tree(const fl* p) { return ((p[0] + p[2]) + (p[1] + p[3])) + ((p[4] + p[6]) + (p[5] + p[7])); }

static void attend_rows(const struct attention_args* a, int first, int rows, int kv_head) {
  const int* table = a->block_tables + first * TV_MAX_BLOCKS;  /* the group's rows read these blocks alike */
  fl qt[TV_HEAD_DIM] __attribute__((aligned(64)));   /* qt[dim][lane]: q transposed */
  fl acc[TV_HEAD_DIM] __attribute__((aligned(64)));  /* acc[dim][lane]: running sum of p * v, transposed */
  il keys;                                            /* keys[lane]: that lane's number of keys */
  int max_keys = 0;
  for (int lane = 0; lane < LANES; lane++) {
    const int r = lane / GROUP, g = lane % GROUP;
    const int n = lane < rows * GROUP ? num_keys_of(a->context_lens, first + r) : 0;  /* spare lanes: no keys */
    const float* q = a->q + ((first + r) * TV_NUM_HEADS + kv_head * GROUP + g) * TV_HEAD_DIM;
    for (int d = 0; d < TV_HEAD_DIM; d++) qt[d][lane] = n ? q[d] : 0.0f;
    keys[lane] = n;
    max_keys = n > max_keys ? n : max_keys;
  }
  for (int d = 0; d < TV_HEAD_DIM; d++) acc[d] = (fl){0};
  fl m = (fl){0} - 3.0e38f, l = (fl){0};
#if TV_CACHE_BITS != 32
  float k_tile[TILE][TV_HEAD_DIM] __attribute__((aligned(32)));
  float v_tile[TILE][TV_HEAD_DIM] __attribute__((aligned(32)));
#else
  float (*k_tile)[TV_HEAD_DIM] = 0, (*v_tile)[TV_HEAD_DIM] = 0;
#endif
  for (int t0 = 0; t0 < max_keys; t0 += TILE) {
    const int n = max_keys - t0 < TILE ? max_keys - t0 : TILE;
    const float* k_rows[TILE];
    const float* v_rows[TILE];
    tile_rows(a, table, kv_head, t0, n, k_rows, v_rows, k_tile, v_tile);
    /* 1. scores, two keys at a time (16 partial sums in registers, each qt[dim] loaded once for both) */
    fl s[TILE] __attribute__((aligned(64)));
    for (int t = 0; t < n; t += 2) {  /* (t + 1 < TILE; a row past n points at a valid row, its score unused) */
      const float* k0 = k_rows[t];
      const float* k1 = k_rows[t + 1];
      fl p0[8], p1[8];  /* p[j]: the partial sum over dims j, j+8, .., j+56 (dot8's lane j) */
      for (int j = 0; j < 8; j++) {
        p0[j] = qt[j] * k0[j];
        p1[j] = qt[j] * k1[j];
      }
      for (int i = 1; i < HD8; i++) {
        for (int j = 0; j < 8; j++) {
          p0[j] += qt[8 * i + j] * k0[8 * i + j];
          p1[j] += qt[8 * i + j] * k1[8 * i + j];
        }
      }
      s[t] = dot8_tree(p0) * TV_SCALE;
      s[t + 1] = dot8_tree(p1) * TV_SCALE;
    }
    /* 2. online softmax, per lane over that lane's keys */
    fl most[4] = {m, m, m, m};  /* four chains (the max of a set is the same bits in any order) */
    for (int t = 0; t < n; t++)
      most[t % 4] = __builtin_elementwise_max(most[t % 4], select_fl(t0 + t < keys, s[t], most[t % 4]));
    const fl m_new = __builtin_elementwise_max(__builtin_elementwise_max(most[0], most[1]),
                                               __builtin_elementwise_max(most[2], most[3]));
    const il live = t0 < keys;  /* lanes with a key in this tile */
    const fl alpha = select_fl(live, expl(m - m_new), (fl){0} + 1.0f);
    fl sum[8];
    for (int j = 0; j < 8; j++) sum[j] = (fl){0};
    for (int t = 0; t < n; t++) {
      const fl p = (fl)((il)expl(s[t] - m_new) & (t0 + t < keys));  /* a lane's keys past its context weigh 0 */
      s[t] = p;
      sum[t % 8] += p;
    }
    m = m_new;
    l = l * alpha + (((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7])));
    /* 3. acc = alpha * acc + sum_t p_t * v_t, 16 dims at a time in registers */
    for (int d0 = 0; d0 < TV_HEAD_DIM; d0 += 16) {
      const int nd = TV_HEAD_DIM - d0 < 16 ? TV_HEAD_DIM - d0 : 16;
      fl o[16];
      for (int d = 0; d < nd; d++) o[d] = acc[d0 + d] * alpha;
      for (int t = 0; t < n; t++) {
        const float* v = v_rows[t] + d0;
        for (int d = 0; d < nd; d++) o[d] += s[t] * v[d];
      }
      for (int d = 0; d < nd; d++) acc[d0 + d] = o[d];
    }
  }
  const fl inv = select_fl(l > 0.0f, 1.0f / l, (fl){0});  /* an empty context (no keys) gives zeros */
  for (int lane = 0; lane < rows * GROUP; lane++) {
    float* out = a->out + ((first + lane / GROUP) * TV_NUM_HEADS + kv_head * GROUP + lane % GROUP) * TV_HEAD_DIM;
    for (int d = 0; d < TV_HEAD_DIM; d++) out[d] = acc[d][lane] * inv[lane];
  }
}

/* chunk = group x KV head: a row alone through attend_chunk, several through attend_rows */
static void attend_group(const void* ctx, int chunk) {
  const struct attention_args* a = (const struct attention_args*)ctx;
  const int group = chunk / TV_NUM_KV_HEADS, kv_head = chunk % TV_NUM_KV_HEADS;
  const int first = a->first_rows[group], rows = a->first_rows[group + 1] - first;
  if (rows == 1) attend_chunk(a, first, kv_head);
  else attend_rows(a, first, rows, kv_head);
}

#endif
