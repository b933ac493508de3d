/* out(M,N) = x(M,K) @ w(N,K)^T, w kept in a 32-element GGUF block format: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or IQ4_NL
 * (TV_QTYPE 2, 3, 6, 7, 8, 20).
 *
 * Why: decoding reads every weight once per token. SmolLM2-135M's 134.5 M linear weights are 538 MB in float32
 * (matmul.c) but 84 MB in Q4_1 (5 bits per weight) and 143 MB in Q8_0 (8.5): at M=1 this kernel has 6.4x (Q4_1)
 * fewer bytes to stream than the float32 one, and the arithmetic stays cheap enough to keep up with the memory.
 *
 * The blocks (tinyvllm/model/quant.py draws them byte by byte), 32 weights each, one float16 scale d:
 *     Q4_0  18 bytes  d, 16 bytes of nibbles q in 0..15      w = d * (q - 8)  = d * q + m   with m = -8 d
 *     Q4_1  20 bytes  d, m, 16 bytes of nibbles q in 0..15   w = d * q + m
 *     Q5_0  22 bytes  d, u32 qh, 16 bytes of nibbles          w = d * (q - 16), q = nibble | (bit j of qh) << 4
 *     Q5_1  24 bytes  d, m, u32 qh, 16 bytes of nibbles       w = d * q + m,    q in 0..31 as Q5_0's
 *     Q8_0  34 bytes  d, 32 int8 q                           w = d * q
 *     IQ4_NL 18 bytes d, 16 bytes of nibbles                 w = d * IQ4NL_VALUES[nibble] (qdot.h: 16 int8 values)
 *   (nibbles: byte j holds q[j] in its low 4 bits and q[j + 16] in its high 4 bits)
 *
 * The route llama.cpp's ggml-cpu takes (ggml-cpu/arch/x86/quants.c, vec_dot_q4_1_q8_1), our own code:
 *   1. quantize each row of x once, into `scratch`: per 32 floats, d_x = max|x| / 127, q_x = round(x / d_x)
 *      (an int8 in -127..127) and s_x = d_x * sum(q_x)                                   (struct xblock, 40 bytes)
 *   2. per block of one row of x and one row of w:
 *          sum_k w_k x_k  ~=  d_w d_x * sum_k q_w,k q_x,k  +  m * s_x
 *      The sum of integer products is exact. AVX2 does 32 of them in two instructions:
 *          _mm256_maddubs_epi16(u8 a[32], i8 b[32]) -> 16 int16  a[2i] b[2i] + a[2i+1] b[2i+1]   (|.| <= 2*15*127)
 *          _mm256_madd_epi16(that, 1)              ->  8 int32   (pairs again)
 *      maddubs wants its first operand unsigned: the nibbles are (Q5: 0..31, |.| <= 2*31*127); a signed q_w (Q8_0,
 *      IQ4_NL, whose nibbles become their values by one byte shuffle) is made so by taking |q_w| and moving its
 *      sign onto q_x (_mm256_sign_epi8; |.| <= 2*128*127 = 32512 still fits an int16). Then one float FMA per
 *      block applies d_w d_x, and the min term m s_x is summed beside it (see `tile`). The only rounding beyond
 *      float32's is that of x to 8 bits (at most half a step, d_x / 2, per element).
 *      On a CPU with AVX-512 VNNI (clang -march=native defines __AVX512VNNI__: the kernels are built on the machine
 *      that runs them) one _mm256_dpbusd_epi32 does maddubs + madd (no int16 step), the same sums, and then AVX2's
 *      float operations in AVX2's order: every route gives the same bits. TV_NO_VNNI builds AVX2's route (the
 *      tests, qlinear.VNNI / TINYVLLM_QMATMUL_VNNI=0).
 *
 * Arguments (M, N, K, TV_QTYPE compile-time constants: one program per shape and format):
 *   out:     (M, N) float32, written
 *   scratch: (M * K/32 * 40) uint8, written then read: x quantized (qlinear.scratch_bytes)
 *   x:       (M, K) float32, rows contiguous
 *   w:       (N, K/32 * block bytes) uint8, the GGUF's blocks, row after row
 *
 * How the work is cut (as matmul.c): quantize x (rows spread over the thread pool), then tiles of MR rows of x
 * times NR rows of w. Each weight block is loaded and unpacked once per tile and used for MR rows of x; each x
 * block for NR rows of w. M=1 (one sequence decoding) is "the stream", below: MR=1, NR=2 for Q4_0/Q4_1 (two rows'
 * FMA chains side by side), NR=1 for Q8_0, AVX2's per-block operations even where AVX-512 is there, and the weights
 * prefetched STREAM_PREFETCH bytes ahead. From 2 to 8 rows of x (a few sequences decoding, or one sequence
 * verifying its speculative drafts) "the few rows", below: the same stream, each block of w applied to every row.
 * More rows: MR=4, NR=2 (measured at M=32 against 2x2, 3x2, 2x3, 2x4, 3x3: the fastest, with AVX2's 16 registers and
 * with AVX-512's 32, though its 8 + 8 accumulators spill a few on AVX2). Every output keeps its own accumulators,
 * updated block by block by the same instructions whatever MR and NR are: a row's result does not depend on the
 * other rows of the step (batch invariance), which the engine's batched-equals-alone tests rely on.
 * With AVX-512 and M > 8 the wide tile takes over (Q8_0 6 x 4 on 512-bit registers, Q4 4 x 4, see "the wide tile"
 * below): the same numbers.
 * Only where a user asks (TV_FLOAT_MIN_M > 0, qlinear.FLOAT_PATH_MIN_M) do M >= TV_FLOAT_MIN_M rows take the float
 * path instead: FNR rows of w dequantized to floats at a time and matmul.c's float32 tile (see "many rows of x"
 * below for why and what it gains). The N rows are cut into chunks of ~24 KB of w (96 at M=1) handed to the thread
 * pool (threadpool.h); in a chunk, x is walked in blocks of MB rows so that a chunk's weights stay in L1/L2 while
 * every row of x passes over them.
 */
#include "threadpool.h"
#include "qdot.h"

#if !defined(TV_M) || !defined(TV_N) || !defined(TV_K) || !defined(TV_QTYPE)
#error "qmatmul.c needs TV_M, TV_N, TV_K and TV_QTYPE (the launcher defines them)"
#endif
/* Each format's traits: BLOCK_BYTES; QS_AT, where its quants start; QH_AT, where a Q5's 32 fifth bits are (a u32);
 * STORED_MIN: w = d q + m with m stored after d; MIN_SCALE: w = d (q + MIN_SCALE), so the min term is MIN_SCALE d s_x
 * (d times a power of two: exact); SIGNED_Q: w = d q with q signed (no min term: x takes w's sign, see below). */
#if TV_QTYPE == 2
#define BLOCK_BYTES 18
#define QS_AT 2
#define MIN_SCALE -8.0f
#elif TV_QTYPE == 3
#define BLOCK_BYTES 20
#define QS_AT 4
#define STORED_MIN 1
#elif TV_QTYPE == 6
#define BLOCK_BYTES 22
#define QH_AT 2
#define QS_AT 6
#define MIN_SCALE -16.0f
#elif TV_QTYPE == 7
#define BLOCK_BYTES 24
#define QH_AT 4
#define QS_AT 8
#define STORED_MIN 1
#elif TV_QTYPE == 8
#define BLOCK_BYTES 34
#define QS_AT 2
#define SIGNED_Q 1
#elif TV_QTYPE == 20
#define BLOCK_BYTES 18
#define QS_AT 2
#define SIGNED_Q 1  /* IQ4_NL: q = IQ4NL_VALUES[nibble], one of 16 int8 values (qdot.h) */
#else
#error "qmatmul.c computes TV_QTYPE 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 20 (IQ4_NL)"
#endif
#ifndef STORED_MIN
#define STORED_MIN 0
#endif
#ifndef SIGNED_Q
#define SIGNED_Q 0
#endif
#ifndef MIN_SCALE
#define MIN_SCALE 1.0f  /* (unused: Q4_1's min is stored, Q8_0 has none) */
#endif
#if TV_K % 32 != 0
#error "K must be a multiple of the 32-element block"
#endif

#ifndef TV_FLOAT_MIN_M
#define TV_FLOAT_MIN_M 0    /* qlinear.FLOAT_PATH_MIN_M passes it: 0 = never the float path (batch-invariant) */
#endif
#define TV_FLOAT_PATH (TV_FLOAT_MIN_M > 0 && TV_M >= TV_FLOAT_MIN_M)
#define FMR 4
#define FNR 3
#define FMB 64              /* rows of x per dequantized tile */

#define NB (TV_K / 32)                     /* blocks per row */
#define ROW_BYTES (NB * BLOCK_BYTES)       /* bytes of one row of w */
/* many rows of x on a CPU with AVX-512: the "wide tile" (below), the same arithmetic in 32 registers (up to
 * FEW_ROWS_MAX_M rows the few rows go first) */
#define WIDE_TILE_MIN_M 8
/* 2 to FEW_ROWS_MAX_M rows of x (a few sequences decoding, or one verifying its drafts): "the few rows" (below),
 * the stream of M = 1 with every row of x applied to each block of w as it passes */
#ifndef FEW_ROWS_MAX_M
#define FEW_ROWS_MAX_M 8
#endif
#define TV_FEW_ROWS (TV_AVX2 && TV_M > 1 && TV_M <= FEW_ROWS_MAX_M && !TV_FLOAT_PATH)
#define TV_WIDE_TILE (TV_AVX512 && TV_M >= WIDE_TILE_MIN_M && !TV_FLOAT_PATH && !TV_FEW_ROWS)
/* M = 1 streams each weight once, so the work per block is what counts: AVX2's 256-bit route, whose operations run
 * on three vector ports, where 512-bit registers holding two blocks each (fewer instructions, but while a 512-bit
 * operation is in flight this CPU's port 1 takes no vector work, and three of their nine operations are shuffles, on
 * port 5 alone) measured 1.2-1.4x slower at every Q4_1 shape of the default model, one thread or two. */
#if TV_WIDE_TILE && !defined(TV_NO_WIDE_PAIRS)
#define TV_WIDE_PAIRS 1  /* the wide tile on 512-bit registers, two rows of w each (see wide_pair_tile) */
#else
#define TV_WIDE_PAIRS 0
#endif
#if TV_FLOAT_PATH
#define MR FMR   /* the float path: tiles of FNR dequantized rows of w */
#define NR FNR
#elif TV_M == 1
#define MR 1
#ifndef TV_TILE_NR
#define TV_TILE_NR (TV_QTYPE == 8 ? 1 : 2)  /* Q4: two independent FMA chains; Q8_0's unpack is heavier, one */
#endif
#define NR TV_TILE_NR
#elif TV_FEW_ROWS
#define MR TV_M
#ifndef TV_TILE_NR
#define TV_TILE_NR (TV_AVX512 ? 2 : 1)  /* M x NR accumulators: AVX-512VL's 32 registers hold 8 x 2, AVX2's 16 8 x 1 */
#endif
#define NR TV_TILE_NR
#elif TV_WIDE_TILE
#ifndef TV_TILE_MR
#define TV_TILE_MR (TV_WIDE_PAIRS && SIGNED_Q ? 6 : 4)
#endif
#ifndef TV_TILE_NR
#define TV_TILE_NR (TV_WIDE_PAIRS ? 4 : SIGNED_Q ? 4 : 3)
#endif
#define MR TV_TILE_MR
#define NR TV_TILE_NR
#else
#define MR 4
#define NR 2
#endif
#define MB 64                               /* rows of x per pass over a chunk: 64 x 1536/32 x 40 B = 123 KB */
#define STREAM_PREFETCH 2048                /* M = 1: prefetch the weights this far ahead of the block in use */
/* KB of w per chunk handed to a thread: ~24, or ~96 at M = 1, where a chunk is one stream through memory (measured
 * against 24 and 48: 1.05-1.1x on the model's shapes, most on lm_head) */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (TV_M == 1 ? TV_STREAM_CHUNK_BYTES(TV_N, ROW_BYTES) : 24576)
#endif
#define CHUNK_TILES ((CHUNK_BYTES / ROW_BYTES + NR - 1) / NR > 0 ? (CHUNK_BYTES / ROW_BYTES + NR - 1) / NR : 1)
#define CHUNK_ROWS (CHUNK_TILES * NR)
#define NUM_CHUNKS ((TV_N + CHUNK_ROWS - 1) / CHUNK_ROWS)
#define QUANT_ROWS 16                       /* rows of x quantized per chunk */
#define NUM_QUANT_CHUNKS ((TV_M + QUANT_ROWS - 1) / QUANT_ROWS)
#include "tile.h"  /* after MR, NR, MB, CHUNK_ROWS: its tiles and loops are cut by them */

/* 32 elements of x, quantized: x ~= d * q. llama.cpp's block_q8_1, with d and s in float32 instead of float16 */
struct xblock {
  float d;             /* max|x| / 127 */
  float s;             /* d * sum(q): what the min term m * sum(x) needs */
  signed char q[32];
};
_Static_assert(sizeof(struct xblock) == 40, "qlinear.X_BLOCK_BYTES['qmatmul'] says 40");

struct qmatmul_args {
  float* out;
  struct xblock* xq;   /* (M, NB) */
  const float* x;
  const unsigned char* w;
};

#if !TV_FLOAT_PATH
static void quantize_chunk(const void* ctx, int chunk);
#endif
static void qmatmul_chunk(const void* ctx, int chunk);

/* The entry point: the first function in this file, so the first in the compiled image. */
TV_KERNEL qmatmul(float* restrict out, unsigned char* restrict scratch, const float* restrict x,
                  const unsigned char* restrict w) {
  struct qmatmul_args args = {out, (struct xblock*)scratch, x, w};
#if !TV_FLOAT_PATH
  tv_parallel_for(quantize_chunk, &args, NUM_QUANT_CHUNKS);  /* every row of x, before any dot product */
#endif
  tv_parallel_for(qmatmul_chunk, &args, NUM_CHUNKS);
}

/* weight k (0..31) of a block as its integer q: Q4 0..15, Q5 0..31 (nibbles: byte j holds q[j] and q[j + 16]),
 * Q8_0 -128..127, IQ4_NL the value its nibble indexes */
TV_INLINE int quant_at(const unsigned char* blk, int k) {
#if TV_QTYPE == 20
  static const signed char values[16] = {IQ4NL_VALUES};
  return values[k < 16 ? blk[QS_AT + k] & 0x0f : blk[QS_AT + k - 16] >> 4];
#elif SIGNED_Q
  return (signed char)blk[QS_AT + k];
#else
  int q = k < 16 ? blk[QS_AT + k] & 0x0f : blk[QS_AT + k - 16] >> 4;
#ifdef QH_AT
  q |= (blk[QH_AT + k / 8] >> (k % 8) & 1) << 4;
#endif
  return q;
#endif
}

#if !TV_FLOAT_PATH
/* ---- step 1: x -> 8-bit blocks ---- */

TV_INLINE void quantize_block(struct xblock* restrict out, const float* restrict x) {
  float max = max_abs(x, 32);
  int sum = quantize_32(out->q, x, max != 0.0f ? 127.0f / max : 0.0f);
  out->d = max / 127.0f;
  out->s = out->d * (float)sum;
}

#if TV_WIDE_TILE
/* The wide tile's scratch, per row of x: the NB blocks' 32 quants back to back, then NB scales d_x, then NB sums
 * s_x (40 bytes per block, as struct xblock). Q8_0's quants are stored plus 128, as unsigned bytes (see wide_tile). */
#define XQ_ROW(xq, m) ((const unsigned char*)(xq) + (long)(m) * NB * 40)
#define XD_ROW(xq, m) ((const float*)(XQ_ROW(xq, m) + NB * 32))
#define XS_ROW(xq, m) (XD_ROW(xq, m) + NB)

static void quantize_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  for (int m = chunk * QUANT_ROWS; m < TV_M && m < (chunk + 1) * QUANT_ROWS; m++) {
    unsigned char* q = (unsigned char*)XQ_ROW(a->xq, m);
    float* d = (float*)XD_ROW(a->xq, m);
    for (int b = 0; b < NB; b++) {
      struct xblock blk;
      quantize_block(&blk, a->x + m * TV_K + 32 * b);
      __m256i v = _mm256_loadu_si256((const __m256i*)blk.q);
#if SIGNED_Q
      v = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));  /* q + 128: 1..255 */
#endif
      _mm256_storeu_si256((__m256i*)(q + 32 * b), v);
      d[b] = blk.d;
      d[NB + b] = blk.s;
    }
  }
}
#elif TV_FEW_ROWS
/* The few rows' scratch: the M rows' quants, 32 bytes per block, row after row (the signed formats' plus 128, as the
 * wide tile's, where VNNI takes them: see few_tile), then the scales d_x and the sums s_x, each block's M values
 * side by side (FEW_D[b * M + i]: one vector load gives block b's scales of every row). 40 bytes per block. */
#define FEW_X128 (SIGNED_Q && TV_VNNI)
#define FEW_Q(xq, i, b) ((const unsigned char*)(xq) + ((long)(i) * NB + (b)) * 32)
#define FEW_D(xq) ((const float*)((const unsigned char*)(xq) + (long)TV_M * NB * 32))
#define FEW_S(xq) (FEW_D(xq) + TV_M * NB)

static void quantize_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  float* d = (float*)FEW_D(a->xq);
  float* s = d + TV_M * NB;
  for (int m = chunk * QUANT_ROWS; m < TV_M && m < (chunk + 1) * QUANT_ROWS; m++)
    for (int b = 0; b < NB; b++) {
      struct xblock blk;
      quantize_block(&blk, a->x + m * TV_K + 32 * b);
      __m256i v = _mm256_loadu_si256((const __m256i*)blk.q);
#if FEW_X128
      v = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));  /* q + 128: 1..255 */
#endif
      _mm256_storeu_si256((__m256i*)FEW_Q(a->xq, m, b), v);
      d[b * TV_M + m] = blk.d;
      s[b * TV_M + m] = blk.s;
    }
}
#else
static void quantize_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
  for (int m = chunk * QUANT_ROWS; m < TV_M && m < (chunk + 1) * QUANT_ROWS; m++)
    for (int b = 0; b < NB; b++) quantize_block(a->xq + m * NB + b, a->x + m * TV_K + 32 * b);
}
#endif

/* ---- step 2: integer dot products, scaled per block ---- */

#if TV_AVX2
#ifdef QH_AT
/* Q5's fifth bits: byte k = 16 where bit k of the block's u32 qh is set, else 0 (element order, as the nibbles) */
TV_INLINE __m256i fifth_bits(const unsigned char* blk) {
  unsigned int qh;
  __builtin_memcpy(&qh, blk + QH_AT, 4);
#if TV_AVX512
  return _mm256_maskz_mov_epi8(_cvtu32_mask32(qh), _mm256_set1_epi8(16));  /* one mask move */
#else
  /* byte k takes byte k / 8 of qh (a shuffle), then tests its bit k % 8: or-ing every other bit in makes the byte
   * all ones exactly where that bit is set */
  const __m256i byte_of = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), byte_of);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi8(-1)), _mm256_set1_epi8(16));
#endif
}
#endif

/* a block's 32 nibbles, one byte each, in element order */
TV_INLINE __m256i nibbles_32(const unsigned char* blk) {
  /* the 16 bytes in both halves (a load, no shuffle), the high half shifted by 4: lo nibbles q[0..15], hi q[16..31] */
  __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + QS_AT)));
  return _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0f));
}

#if SIGNED_Q
/* 32 signed quants of one block: Q8_0's bytes as they are; IQ4_NL's values, one byte shuffle looks all 32 up */
TV_INLINE __m256i signed_quants(const unsigned char* blk) {
#if TV_QTYPE == 20
  return _mm256_shuffle_epi8(_mm256_setr_epi8(IQ4NL_VALUES, IQ4NL_VALUES), nibbles_32(blk));
#else
  return _mm256_loadu_si256((const __m256i*)(blk + QS_AT));
#endif
}
#else
/* 32 unsigned quants of one block in one register */
TV_INLINE __m256i unpack_block(const unsigned char* blk) {
#ifdef QH_AT
  return _mm256_or_si256(nibbles_32(blk), fifth_bits(blk));  /* Q5: 0..31 */
#else
  return nibbles_32(blk);
#endif
}
#endif

/* 8 int32 partial sums of q_w * q_x over one block (u: unpack_block's register, or |q_w| for the signed formats,
 * whose signed q_w are v) */
TV_INLINE __m256i block_dot(__m256i u, __m256i v, __m256i xq) {
#if SIGNED_Q
  xq = _mm256_sign_epi8(xq, v);  /* x takes w's sign */
#else
  (void)v;
#endif
#if TV_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xq);  /* one instruction, the same int32 sums */
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), _mm256_set1_epi16(1));
#endif
}

/* The block's float16 scale(s) as 8 floats: Q4_1 [d, m, d, m, ...] (d and m are adjacent), else [d, d, ...] */
TV_INLINE __m256 block_scales(const unsigned char* blk) {
#if STORED_MIN
  return _mm256_cvtph_ps(_mm_castps_si128(_mm_broadcast_ss((const float*)blk)));  /* d, m: 4 bytes broadcast */
#else
  unsigned short d;
  __builtin_memcpy(&d, blk, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16((short)d));
#endif
}


/* out[i, j] = dot(x[i, :], w[j, :]) for i < mr, j < nr. mr and nr are constants at every call site, so clang
 * unrolls both loops and keeps acc[][] in registers.
 * Per block, one multiply gives both scales: [d_w, m_w, ...] * [d_x, s_x, ...] = [d_w d_x, m_w s_x, ...]
 * (x's d and s are adjacent in struct xblock): the even lanes scale the integer dot, lane 1 is the min term. */
TV_INLINE void tile(float* restrict out, const struct xblock* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  __m256 acc[MR][NR], mins[MR][NR];  /* mins: lane 1 sums m_w s_x (Q4_0: d_w s_x, times -8 at the end) */
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = mins[i][j] = _mm256_setzero_ps();
  for (int b = 0; b < NB; b++) {
    __m256i u[NR], v[NR];
    __m256 ws[NR];
    for (int j = 0; j < nr; j++) {
      const unsigned char* blk = w + j * ROW_BYTES + b * BLOCK_BYTES;
#if SIGNED_Q
      v[j] = signed_quants(blk);
      u[j] = _mm256_sign_epi8(v[j], v[j]);  /* |q_w|: maddubs wants one operand unsigned, x takes the signs */
#else
      u[j] = v[j] = unpack_block(blk);
#endif
      ws[j] = block_scales(blk);
#if MR > 1
      /* the next tile's rows, same block; past the last row of w a harmless no-op (prefetches never fault) */
      __builtin_prefetch(blk + NR * ROW_BYTES, 0, 3);
#else
      __builtin_prefetch(blk + STREAM_PREFETCH, 0, 3);  /* the stream: the hardware prefetcher alone runs behind */
#endif
    }
    for (int i = 0; i < mr; i++) {
      const struct xblock* xb = x + i * NB + b;
      __m256i xq = _mm256_loadu_si256((const __m256i*)xb->q);
      __m256 xs = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)&xb->d));  /* [d_x, s_x, d_x, s_x, ...] */
      for (int j = 0; j < nr; j++) {
        __m256 dot = _mm256_cvtepi32_ps(block_dot(u[j], v[j], xq));
        __m256 p = _mm256_mul_ps(ws[j], xs);
        acc[i][j] = _mm256_fmadd_ps(dot, _mm256_moveldup_ps(p), acc[i][j]);
#if !SIGNED_Q
        mins[i][j] = _mm256_add_ps(mins[i][j], p);
#endif
      }
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      float m = mins[i][j][1];
#if !STORED_MIN && !SIGNED_Q
      m *= MIN_SCALE;  /* Q4_0: w = d (q - 8), so the min term is -8 d_w s_x (Q5_0: -16) */
#endif
      out[i * TV_N + j] = hsum8(acc[i][j]) + m;
    }
}

#if TV_FEW_ROWS
/* ---- a few rows of x: the stream, every row of x on each block of w ----
 * At M = 1 each weight is used once, and the kernel streams the weights from memory. With a few rows of x (a few
 * sequences decoding, or one sequence verifying k drafts: k + 1 rows) the weights still dominate: each block of w
 * is read once, unpacked once, and every row of x (M x 32 bytes per block, in L1) takes its dot product with it
 * while it is in registers. Per (row of x, row of w, block) what is left is what `tile` must do for that output:
 * one integer dot product, one conversion, one FMA. The rest is per row of w, shared by the M rows of x:
 *   - the scales: before the blocks, one pass over the row's float16 scales (few_scales) writes every product
 *     d_w d_x (block b, row i at P[8 b + i], the M rows' d_x in one vector, FEW_D) and sums the min term of every
 *     row of x at once (lane i: m_w s_x, block after block, as `tile`'s lane 1); the FMA takes its scale from P as
 *     a broadcast load;
 *   - the signed formats with VNNI: x stored plus 128 and one dpbusd from -128 sum q_w (the wide tile's trick), so
 *     no sign instruction per output.
 * The numbers are `tile`'s: the same integer sums in the same 8 lanes, the same products d_w d_x and m_w s_x,
 * acc = fma(float(sums), d_w d_x, acc) and the min term summed block after block from zero, out = hsum8(acc) +
 * min term. A row's output does not depend on M, nor on which route its M takes. */

/* M floats (M <= 8) in a vector, the lanes past M zero (a masked load: nothing past the M is read) */
TV_INLINE __m256 few_lanes(const float* p) {
#if TV_M == 8
  return _mm256_loadu_ps(p);
#else
  const __m256i mask = _mm256_setr_epi32(-(0 < TV_M), -(1 < TV_M), -(2 < TV_M), -(3 < TV_M), -(4 < TV_M),
                                         -(5 < TV_M), -(6 < TV_M), -(7 < TV_M));
  return _mm256_maskload_ps(p, mask);
#endif
}

/* The scales of nr rows of w (row j at w + j ROW_BYTES): P[j][8 b + i] = d_w,b d_x,i,b for every block b and row i
 * of x; mins[j], lane i: the min term sum_b m_w,b s_x,i,b (Q4_0, Q5_0: d_w,b s_x,i,b, times MIN_SCALE at the end),
 * block after block (the nr rows side by side: each sum is a chain of dependent adds) */
TV_INLINE void few_scales(float (*restrict P)[NB * 8], __m256* restrict mins, const unsigned char* restrict w,
                          const void* restrict xq, int nr) {
  const float* dx = FEW_D(xq);
  const float* sx = FEW_S(xq);
  (void)sx;
  for (int j = 0; j < nr; j++) mins[j] = _mm256_setzero_ps();
#pragma clang loop unroll(disable)
  for (int b = 0; b < NB; b++) {
    const __m256 dxb = few_lanes(dx + b * TV_M);
#if !SIGNED_Q
    const __m256 sxb = few_lanes(sx + b * TV_M);
#endif
    for (int j = 0; j < nr; j++) {
      const unsigned char* blk = w + j * ROW_BYTES + b * BLOCK_BYTES;
      /* the float16 scale d (Q4_1: and m after it) converted in the low lanes, then broadcast */
      unsigned int dm;
      __builtin_memcpy(&dm, blk, STORED_MIN ? 4 : 2);
      const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(STORED_MIN ? dm : dm & 0xffff)));
      const __m256 dw = _mm256_broadcastss_ps(both);
#if STORED_MIN
      const __m256 mw = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
#else
      const __m256 mw = dw;  /* Q4_0, Q5_0: d, times MIN_SCALE at the end */
#endif
      _mm256_store_ps(P[j] + 8 * b, _mm256_mul_ps(dw, dxb));
#if SIGNED_Q
      (void)mw;
#else
      mins[j] = _mm256_add_ps(mins[j], _mm256_mul_ps(mw, sxb));
#endif
    }
  }
}

/* out[i, j] for every row i of x and j < nr (rows of w from w) */
TV_INLINE void few_tile(float* restrict out, const void* restrict xq, const unsigned char* restrict w, int nr) {
  _Alignas(32) float P[NR][NB * 8];
  __m256 mins[NR];
#if SIGNED_Q  /* no min sums to interleave: row by row (measured faster on Q8_0's lm_head) */
  for (int j = 0; j < nr; j++) few_scales(P + j, mins + j, w + j * ROW_BYTES, xq, 1);
#else
  few_scales(P, mins, w, xq, nr);
#endif
  __m256 acc[NR][TV_M];
  for (int j = 0; j < nr; j++)
    for (int i = 0; i < TV_M; i++) acc[j][i] = _mm256_setzero_ps();
#pragma clang loop unroll(disable)
  for (int b = 0; b < NB; b++) {
    __m256i u[NR], v[NR];  /* FEW_X128: u is where the dot product starts, -128 sum q_w per lane */
    for (int j = 0; j < nr; j++) {
      const unsigned char* blk = w + j * ROW_BYTES + b * BLOCK_BYTES;
#if FEW_X128
      v[j] = signed_quants(blk);
      u[j] = _mm256_sub_epi32(_mm256_setzero_si256(),
                              _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), v[j]));
#elif SIGNED_Q
      v[j] = signed_quants(blk);
      u[j] = _mm256_sign_epi8(v[j], v[j]);
#else
      u[j] = v[j] = unpack_block(blk);
#endif
      __builtin_prefetch(blk + STREAM_PREFETCH, 0, 3);
    }
    for (int i = 0; i < TV_M; i++) {
      __m256i xv = _mm256_loadu_si256((const __m256i*)FEW_Q(xq, i, b));
      for (int j = 0; j < nr; j++) {
#if FEW_X128
        __m256i dot = _mm256_dpbusd_epi32(u[j], xv, v[j]);
#else
        __m256i dot = block_dot(u[j], v[j], xv);
#endif
        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&P[j][8 * b + i]), acc[j][i]);
      }
    }
  }
  for (int j = 0; j < nr; j++) {
    _Alignas(32) float mn[8];
#if !STORED_MIN && !SIGNED_Q
    mins[j] = _mm256_mul_ps(mins[j], _mm256_set1_ps(MIN_SCALE));
#endif
    _mm256_store_ps(mn, mins[j]);
    for (int i = 0; i < TV_M; i++) out[i * TV_N + j] = hsum8(acc[j][i]) + mn[i];
  }
}

/* output columns [n0, n1) for every row of x */
TV_INLINE void few_chunk(float* restrict out, const void* restrict xq, const unsigned char* restrict w, int n0,
                         int n1) {
  int n = n0;
  for (; n + NR <= n1; n += NR) few_tile(out + n, xq, w + (long)n * ROW_BYTES, NR);
  for (; n < n1; n++) few_tile(out + n, xq, w + (long)n * ROW_BYTES, 1);
}
#endif  /* TV_FEW_ROWS */

#if TV_WIDE_TILE
/* ---- many rows of x with AVX-512: the wide tile ----
 * The same numbers as `tile` (AVX2's route): per block the same exact integer sums in the
 * same 8 lanes, then acc = fma(float(sums), d_w d_x, acc), the min term summed alone, out = hsum8(acc) + min term.
 * What changes is what each (row of x, row of w, block) costs, the work that grows with M x N:
 *   - 256-bit operations only: this CPU's port 1 stops taking vector work while a 512-bit one is in flight, so
 *     two 256-bit ops per cycle (ports 0 and 1) do as much as one 512-bit, and AVX-512VL's 32 ymm registers hold an
 *     MR x NR tile of 4 x 4 (Q8_0) or 4 x 3 (Q4_0, Q4_1, with their scalar min sums) accumulators;
 *   - the products d_w d_x (and m_w s_x) of the whole tile computed first, NB at a time, so that each block's scale
 *     comes from memory as the FMA's broadcast operand instead of a multiply and two shuffles;
 *   - Q8_0 without the sign trick: x is stored plus 128 (unsigned, 1..255) and w stays signed, so one
 *     _mm256_dpbusd_epi32 gives sum (q_x + 128) q_w; it starts from -128 sum q_w per lane (computed once per row of
 *     w and block in `wide_chunk`, shared by every row of x), which leaves sum q_x q_w, the same integers.
 * So per (row of x, row of w, block): one dpbusd, one conversion, one FMA (plus Q4's scalar add).
 * Where the CPU has two 512-bit FMA units (Intel's server cores; on others a 512-bit operation costs two 256-bit
 * ones, no loss) the whole tiles go further: two rows of w in each 512-bit register (wide_pair_tile), 6 x 4 outputs
 * for Q8_0 (the tied embedding's lm_head, 49,152 rows), 4 x 4 for Q4 (its min sums take registers too), the same
 * lanes and the same bits; wide_tile keeps the N % NR rows left over (and TV_NO_WIDE_PAIRS builds it alone). */
/* dst[b] = a[b] * c[b] for b < NB (written with intrinsics: left to itself, clang turns the tile's loops over i, j
 * and b into gathers and scatters) */
TV_INLINE void mul_blocks(float* restrict dst, const float* restrict a, const float* restrict c) {
  int b = 0;
  for (; b + 8 <= NB; b += 8) _mm256_storeu_ps(dst + b, _mm256_mul_ps(_mm256_loadu_ps(a + b), _mm256_loadu_ps(c + b)));
  for (; b < NB; b++) dst[b] = a[b] * c[b];
}

#if TV_WIDE_PAIRS
/* The wide tile on 512-bit registers: each holds two outputs' 8 lanes, rows j and j+1 of w side by side,
 *     Q8_0  dot[i][p] = dpbusd([start_2p | start_2p+1], [q_x,i | q_x,i], [q_w,2p | q_w,2p+1])     (16 int32 lanes)
 *     Q4    dot[i][p] = dpbusd(0, [q_w,2p | q_w,2p+1], [q_x,i | q_x,i])
 *           acc[i][p] = fma(float(dot[i][p]), [d_w,2p d_x,i (x8) | d_w,2p+1 d_x,i (x8)], acc[i][p])
 *     Q4    mins[i][p] += [m_w,2p s_x,i (x8) | m_w,2p+1 s_x,i (x8)]        (the min term, its lanes all alike)
 * lane for lane the integers and float operations of wide_tile (the scale is the same product d_w * d_x, the min
 * term the same product m_w * s_x, summed from 0 block after block), so the same bits; per (row of x, two rows of
 * w, block) one dpbusd, one conversion, one multiply and one FMA (Q4: and a multiply and an add) instead of two of
 * each (and no scale table per tile). Q4 has the min sums too, so 4 x 4 outputs fit the 32 registers; Q8_0 takes 6 x 4 (12 accumulators, and each
 * block's w registers, built with three inserts per pair of rows, serve six rows of x instead of four). */
/* One block of two rows of w, 2p and 2p+1, as wide_pair_tile's registers: built once per chunk (wide_chunk), then
 * loaded, three aligned loads, by every tile of rows of x, where building them costs three inserts (and Q4's
 * unpacking) per pair of rows and block. */
struct pair_block {
  __m512i q;      /* [q_w,2p | q_w,2p+1]: Q8_0's quants, Q4's unpacked to one byte each (unpack_block) */
  __m512i start;  /* Q8_0: [start_2p | start_2p+1]; Q4: [m_w,2p (x8) | m_w,2p+1 (x8)], a float vector's bits */
  __m512 d;       /* [d_w,2p (x8) | d_w,2p+1 (x8)] */
};

/* Block b of rows r, r+1 of w (blk: row r's block b; dw, mw, w128: wide_chunk's per-row tables) as a pair block */
TV_INLINE struct pair_block pair_block_of(const unsigned char* restrict blk, const float* restrict dw,
                                          const float* restrict mw, const __m256i* restrict w128, int r, int b) {
  struct pair_block o;
#if SIGNED_Q
  (void)mw;
  o.q = _mm512_inserti64x4(_mm512_castsi256_si512(signed_quants(blk)), signed_quants(blk + ROW_BYTES), 1);
  o.start = _mm512_inserti64x4(_mm512_castsi256_si512(w128[r * NB + b]), w128[(r + 1) * NB + b], 1);
#else
  (void)w128;
  o.q = _mm512_inserti64x4(_mm512_castsi256_si512(unpack_block(blk)), unpack_block(blk + ROW_BYTES), 1);
  o.start = _mm512_castps_si512(
      _mm512_insertf32x8(_mm512_set1_ps(mw[r * NB + b]), _mm256_set1_ps(mw[(r + 1) * NB + b]), 1));
#endif
  o.d = _mm512_insertf32x8(_mm512_set1_ps(dw[r * NB + b]), _mm256_set1_ps(dw[(r + 1) * NB + b]), 1);
  return o;
}

/* pb[r / 2 * NB + b] <- rows r, r+1 of w (rows n0 + r of the chunk), every block */
TV_INLINE void build_pair_blocks(struct pair_block* restrict pb, const unsigned char* restrict w, int rows,
                                 const float* restrict dw, const float* restrict mw, const __m256i* restrict w128) {
  for (int r = 0; r + 1 < rows; r += 2)
    for (int b = 0; b < NB; b++)
      pb[r / 2 * NB + b] = pair_block_of(w + (long)r * ROW_BYTES + b * BLOCK_BYTES, dw, mw, w128, r, b);
}

/* From PAIR_BLOCKS_MIN_M rows of x on, the pair blocks are built once per chunk; below, each tile builds its
 * registers itself: with few tiles of rows to share them, storing and loading them back costs more than it saves
 * (measured: Q8_0 equal at 32 rows and faster from 64; Q4, whose blocks are unpacked too, faster from 16). */
#define PAIR_BLOCKS_MIN_M (TV_QTYPE == 8 ? 48 : 16)
#define TV_PAIR_BLOCKS (TV_M >= PAIR_BLOCKS_MIN_M)

TV_INLINE void wide_pair_tile(float* restrict out, const void* restrict xq, int m, const unsigned char* restrict w,
                              const float* restrict dw, const float* restrict mw, const __m256i* restrict w128,
                              const struct pair_block* restrict pb, int mr) {
  __m512 acc[MR][NR / 2];
#if !SIGNED_Q
  __m512 mins[MR][NR / 2];
#endif
  for (int i = 0; i < mr; i++)
    for (int p = 0; p < NR / 2; p++) {
      acc[i][p] = _mm512_setzero_ps();
#if !SIGNED_Q
      mins[i][p] = _mm512_setzero_ps();
#endif
    }
#pragma clang loop unroll(disable)
  for (int b = 0; b < NB; b++) {
    __m512i wv[NR / 2];
    __m512 ds[NR / 2];  /* [d_w,2p (x8) | d_w,2p+1 (x8)] */
#if SIGNED_Q
    __m512i start[NR / 2];
#else
    __m512 ms[NR / 2];  /* [m_w,2p (x8) | m_w,2p+1 (x8)] */
#endif
    for (int p = 0; p < NR / 2; p++) {
#if TV_PAIR_BLOCKS
      (void)w, (void)dw, (void)mw, (void)w128;
      const struct pair_block o = pb[p * NB + b];
#else  /* the same registers, built here */
      (void)pb;
      const unsigned char* blk = w + 2 * p * ROW_BYTES + b * BLOCK_BYTES;
      const struct pair_block o = pair_block_of(blk, dw, mw, w128, 2 * p, b);
      __builtin_prefetch(blk + NR * ROW_BYTES, 0, 3);  /* the next tile's rows, same block */
      __builtin_prefetch(blk + (NR + 1) * ROW_BYTES, 0, 3);
#endif
      wv[p] = o.q;
#if SIGNED_Q
      start[p] = o.start;
#else
      ms[p] = _mm512_castsi512_ps(o.start);
#endif
      ds[p] = o.d;
    }
    for (int i = 0; i < mr; i++) {
      __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(XQ_ROW(xq, m + i) + 32 * b)));
      __m512 xd = _mm512_set1_ps(XD_ROW(xq, m + i)[b]);
#if !SIGNED_Q
      __m512 xs = _mm512_set1_ps(XS_ROW(xq, m + i)[b]);
#endif
      for (int p = 0; p < NR / 2; p++) {
#if SIGNED_Q
        __m512i dot = _mm512_dpbusd_epi32(start[p], xv, wv[p]);
#else
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[p], xv);
        mins[i][p] = _mm512_add_ps(mins[i][p], _mm512_mul_ps(ms[p], xs));
#endif
        acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ds[p], xd), acc[i][p]);
      }
    }
  }
  for (int i = 0; i < mr; i++)
    for (int p = 0; p < NR / 2; p++) {
#if SIGNED_Q
      float lo = 0.0f, hi = 0.0f;  /* wide_tile's (zero) min term */
#else
      float lo = _mm512_cvtss_f32(mins[i][p]), hi = _mm512_cvtss_f32(_mm512_shuffle_f32x4(mins[i][p], mins[i][p], 2));
#endif
#if !STORED_MIN && !SIGNED_Q
      lo *= MIN_SCALE, hi *= MIN_SCALE;  /* Q4_0: w = d (q - 8), so the min term is -8 d_w s_x (Q5_0: -16) */
#endif
      out[i * TV_N + 2 * p] = hsum8(_mm512_castps512_ps256(acc[i][p])) + lo;
      out[i * TV_N + 2 * p + 1] = hsum8(_mm512_extractf32x8_ps(acc[i][p], 1)) + hi;
    }
}
#endif

#if !TV_WIDE_PAIRS
struct pair_block;  /* (only the 512-bit pairs have them) */
#endif

TV_INLINE void wide_tile(float* restrict out, const void* restrict xq, int m, const unsigned char* restrict w,
                         const float* restrict dw, const float* restrict mw, const __m256i* restrict w128,
                         const struct pair_block* restrict pb, int mr, int nr) {
#if TV_WIDE_PAIRS
  if (nr == NR) {  /* whole tiles on 512-bit registers; the N % NR leftover rows, one at a time, below */
    wide_pair_tile(out, xq, m, w, dw, mw, w128, pb, mr);
    return;
  }
#else
  (void)pb;
#endif
  float p[MR][NR][NB];  /* d_w d_x of block b */
#if !SIGNED_Q
  float pm[MR][NR][NB];  /* the min term: m_w s_x (Q4_0: d_w s_x, times -8 at the end) */
#endif
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      mul_blocks(p[i][j], dw + j * NB, XD_ROW(xq, m + i));
#if !SIGNED_Q
      mul_blocks(pm[i][j], mw + j * NB, XS_ROW(xq, m + i));
#endif
    }
  __m256 acc[MR][NR];
  float mins[MR][NR];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps(), mins[i][j] = 0.0f;
#pragma clang loop unroll(disable)  /* unrolled whole (a short K), the tile's registers spill */
  for (int b = 0; b < NB; b++) {
    __m256i wv[NR];
#if SIGNED_Q
    __m256i start[NR];  /* -128 sum q_w per lane: what sum (q_x + 128) q_w has too much */
#else
    (void)w128;
#endif
    for (int j = 0; j < nr; j++) {
      const unsigned char* blk = w + j * ROW_BYTES + b * BLOCK_BYTES;
#if SIGNED_Q
      wv[j] = signed_quants(blk);
      start[j] = w128[j * NB + b];
#else
      wv[j] = unpack_block(blk);
#endif
      __builtin_prefetch(blk + NR * ROW_BYTES, 0, 3);  /* the next tile's rows, same block */
    }
    for (int i = 0; i < mr; i++) {
      __m256i xv = _mm256_loadu_si256((const __m256i*)(XQ_ROW(xq, m + i) + 32 * b));
      for (int j = 0; j < nr; j++) {
#if SIGNED_Q
        __m256i dot = _mm256_dpbusd_epi32(start[j], xv, wv[j]);
#else
        __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[j], xv);
        mins[i][j] += pm[i][j][b];
#endif
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(p[i][j][b]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      float mn = mins[i][j];
#if !STORED_MIN && !SIGNED_Q
      mn *= MIN_SCALE;
#endif
      out[i * TV_N + j] = hsum8(acc[i][j]) + mn;
    }
}

/* rows m0..m1 of x against rows n..n+nr of w (dw, mw: their scales as floats; pb: their pair blocks) */
TV_INLINE void wide_column(float* restrict out, const void* restrict xq, const unsigned char* restrict w,
                           const float* restrict dw, const float* restrict mw, const __m256i* restrict w128,
                           const struct pair_block* restrict pb, int n, int m0, int m1, int nr) {
#define WIDE_TILE_AT(mr) wide_tile(out + m * TV_N + n, xq, m, w + n * ROW_BYTES, dw, mw, w128, pb, mr, nr)
  int m = m0;
  for (; m + MR <= m1; m += MR) WIDE_TILE_AT(MR);
  switch (m1 - m) {  /* a constant mr per case, so each case is its own unrolled tile */
#if MR > 5
    case 5: WIDE_TILE_AT(5); break;
#endif
#if MR > 4
    case 4: WIDE_TILE_AT(4); break;
#endif
    case 3: WIDE_TILE_AT(3); break;
    case 2: WIDE_TILE_AT(2); break;
    case 1: WIDE_TILE_AT(1); break;
    default: break;
  }
#undef WIDE_TILE_AT
}

/* output columns [n0, n1): the rows' float16 scales as floats once, then tiles over every row of x */
TV_INLINE void wide_chunk(float* restrict out, const void* restrict xq, const unsigned char* restrict w,
                          int n0, int n1) {
  float dw[CHUNK_ROWS * NB], mw[CHUNK_ROWS * NB];
#if SIGNED_Q
  __m256i w128[CHUNK_ROWS * NB];  /* per row and block: -128 sum q_w per lane, where each dot product starts */
#else
  __m256i* w128 = 0;
#endif
  for (int r = 0; r < n1 - n0; r++)
    for (int b = 0; b < NB; b++) {
      const unsigned char* blk = w + (long)(n0 + r) * ROW_BYTES + b * BLOCK_BYTES;
      dw[r * NB + b] = f16_to_f32(blk);
      mw[r * NB + b] = STORED_MIN ? f16_to_f32(blk + 2) : dw[r * NB + b];  /* Q4_0: d, times -8 at the end */
#if SIGNED_Q
      __m256i q = signed_quants(blk);
      w128[r * NB + b] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                          _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), q));
#endif
    }
  const int whole = (n1 - n0) / NR * NR;  /* rows in whole tiles */
#if TV_WIDE_PAIRS && TV_PAIR_BLOCKS
  struct pair_block pb[CHUNK_ROWS / 2 * NB];  /* the whole tiles' rows by pairs */
  build_pair_blocks(pb, w + (long)n0 * ROW_BYTES, whole, dw, mw, w128);
#define PAIRS_AT(r) (pb + (r) / 2 * NB)
#else
#define PAIRS_AT(r) ((const struct pair_block*)0)
#endif
  for (int m0 = 0; m0 < TV_M; m0 += MB) {
    int m1 = m0 + MB < TV_M ? m0 + MB : TV_M;
    int n = n0;
    for (; n < n0 + whole; n += NR)
      wide_column(out, xq, w, dw + (n - n0) * NB, mw + (n - n0) * NB, w128 + (n - n0) * NB, PAIRS_AT(n - n0), n,
                  m0, m1, NR);
    for (; n < n1; n++)
      wide_column(out, xq, w, dw + (n - n0) * NB, mw + (n - n0) * NB, w128 + (n - n0) * NB, 0, n, m0, m1, 1);
  }
#undef PAIRS_AT
}
#endif  /* TV_WIDE_TILE */

#else  /* portable C */

/* The min term's m of a block: Q4_1 stores it, Q4_0's is -8 d and Q5_0's -16 d (exact: powers of two), Q8_0 has
 * none. */
TV_INLINE float block_min(const unsigned char* blk, float d) {
#if STORED_MIN
  (void)d;
  return f16_to_f32(blk + 2);
#else
  (void)blk;
  return MIN_SCALE * d;
#endif
}

TV_INLINE int block_dot_scalar(const unsigned char* blk, const signed char* xq) {
  int sum = 0;
  for (int k = 0; k < 32; k++) sum += quant_at(blk, k) * xq[k];
  return sum;
}

TV_INLINE void tile(float* restrict out, const struct xblock* restrict x, const unsigned char* restrict w,
                    int mr, int nr) {
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      float acc = 0.0f;
      for (int b = 0; b < NB; b++) {
        const unsigned char* blk = w + j * ROW_BYTES + b * BLOCK_BYTES;
        const struct xblock* xb = x + i * NB + b;
        float dw = f16_to_f32(blk);
        acc += dw * xb->d * (float)block_dot_scalar(blk, xb->q);
#if !SIGNED_Q
        acc += block_min(blk, dw) * xb->s;
#endif
      }
      out[i * TV_N + j] = acc;
    }
}
#endif

TV_TILE_COLUMN_FN(tile_column, tile, struct xblock, NB, unsigned char, ROW_BYTES)

#endif  /* !TV_FLOAT_PATH */

/* ---- many rows of x (M >= TV_FLOAT_MIN_M): dequantize a few rows of w once, then float32 FMAs ----
 *
 * Per block and pair (row of x, row of w) the integer route costs a maddubs, a madd, a conversion, a scale and an
 * FMA: more than the 4 float32 FMAs that do the same 32 products (measured on one core: ~75 GFLOP/s against
 * matmul.c's ~100 once M >= 8, weights in cache). Its advantage is touching each weight once per row of x; with
 * many rows it is the arithmetic that counts. So from TV_FLOAT_MIN_M rows on, the kernel dequantizes FNR rows of
 * w into a float buffer (L1) and runs matmul.c's 4x3 register tile over the rows of x, in float32 (x not rounded:
 * these rows get the float product of the dequantized weights). The weights still come from memory as blocks,
 * 4.5-8.5 bits per weight, and each dequantized tile serves up to FMB rows of x. Measured on one core, Q4_1
 * 960x576 in cache: M=8 integer 76 GFLOP/s, float path 66; M=12: 76 against 85; M=32: 73 against 97 (matmul.c
 * float32: 102); M=128: float path 102, matmul.c 98. Hence the switch at 12 rows.
 * dequantize_row (below) gives one row of w as K floats; the first pass (x to 8 bits) is skipped on this path.
 * (qmatmul_k.c has no such path: its integer sums are cheaper, see there.)
 */
TV_INLINE void dequantize_row(float* restrict dst, const unsigned char* restrict row);  /* below */

/* dst[k] = scale[k / sub] * q[k] + offset[k / sub] for k < n: integers of a block to floats (n, sub: multiples of 8) */
TV_INLINE void affine_to_float(float* restrict dst, const signed char* restrict q, int n, int sub,
                               const float* restrict scale, const float* restrict offset) {
#if TV_AVX2
  for (int k = 0; k < n; k += 8) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + k))));
    _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(v, _mm256_set1_ps(scale[k / sub]), _mm256_set1_ps(offset[k / sub])));
  }
#else
  for (int k = 0; k < n; k++) dst[k] = scale[k / sub] * (float)q[k] + offset[k / sub];
#endif
}

/* tile.h's float_tile (matmul.c's tile) on the dequantized rows: wt holds only these rows, nothing to prefetch */
#define FLOAT_TILE(out, x, wt, mr, nr) float_tile(out, x, wt, mr, nr, 0)
TV_TILE_COLUMN_FN(float_tile_column, FLOAT_TILE, float, TV_K, float, 0)  /* wt: the column's rows, at n = 0 */

/* output columns [n0, n1) for every row of x: w's rows n0..n1 (row_bytes each) dequantized FNR at a time */
TV_INLINE void float_chunk(float* restrict out, const float* restrict x, const unsigned char* restrict w,
                           int row_bytes, int n0, int n1) {
  float wt[FNR * TV_K];  /* FNR rows of w as floats: 3 x 1536 x 4 B = 18 KB for the model's widest K */
  for (int m0 = 0; m0 < TV_M; m0 += FMB) {
    int m1 = m0 + FMB < TV_M ? m0 + FMB : TV_M;
    for (int n = n0; n < n1; n += FNR) {
      int nr = n1 - n < FNR ? n1 - n : FNR;
      for (int j = 0; j < nr; j++) dequantize_row(wt + j * TV_K, w + (long)(n + j) * row_bytes);
      switch (nr) {
        case 3: float_tile_column(out + n, x, wt, 0, m0, m1, 3); break;
        case 2: float_tile_column(out + n, x, wt, 0, m0, m1, 2); break;
        default: float_tile_column(out + n, x, wt, 0, m0, m1, 1); break;
      }
    }
  }
}

/* One row of w as floats, for the float path: its integers q, then d * q + m per block */
TV_INLINE void dequantize_row(float* restrict dst, const unsigned char* restrict row) {
  for (int b = 0; b < NB; b++) {
    const unsigned char* blk = row + b * BLOCK_BYTES;
    float d = f16_to_f32(blk);
#if TV_QTYPE == 8
    float m = 0.0f;
    const signed char* q = (const signed char*)(blk + QS_AT);
#else
    float m = SIGNED_Q ? 0.0f : STORED_MIN ? f16_to_f32(blk + 2) : MIN_SCALE * d;
    signed char q[32];
    for (int k = 0; k < 32; k++) q[k] = (signed char)quant_at(blk, k);
#endif
    affine_to_float(dst + 32 * b, q, 32, 32, &d, &m);
  }
}

/* One chunk: output columns [n0, n1) for every row of x. */
static void qmatmul_chunk(const void* ctx, int chunk) {
  const struct qmatmul_args* a = (const struct qmatmul_args*)ctx;
#if TV_FLOAT_PATH
  float_chunk(a->out, a->x, a->w, ROW_BYTES, chunk * CHUNK_ROWS, TV_CHUNK_END(chunk));
#elif TV_FEW_ROWS
  few_chunk(a->out, a->xq, a->w, chunk * CHUNK_ROWS, TV_CHUNK_END(chunk));
#elif TV_WIDE_TILE
  wide_chunk(a->out, a->xq, a->w, chunk * CHUNK_ROWS, TV_CHUNK_END(chunk));
#else
  TV_CHUNK_COLUMNS(tile_column, chunk, a->out, a->xq, a->w);
#endif
}
