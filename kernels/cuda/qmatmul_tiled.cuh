/* The quantized matmul for many rows of x (M > 8): output tiles of 64 x 64 staged through shared memory, integer
 * dot products (dp4a) on x quantized to 8 bits. Included by qmatmul.cu and qmatmul_k.cu, which give it the
 * weights' unpacking (`load_unit`); the twin of kernels/metal/qmatmul_tiled.h (same layout, same index math).
 *
 * Why: the one-warp-per-output kernel (the GEMV route, kept for M <= 8) reads row n of w once for every row of x:
 * at M = 256 it streams the weights 256 times. Per 32-weight unit and per pair (m, n) it does 64 flops, so its
 * arithmetic intensity is 2-3 flops per byte of weights read (Q4_1: 64 flops / 20 B = 3.2; Q8_0: 64 / 34 = 1.9),
 * while an H100 does ~20 float flops in the time it reads a byte (67 TFLOP/s over 3.35 TB/s, its data sheet):
 * at M > 1 that kernel waits on memory with its arithmetic units idle.
 * Here a thread block stages a 64-row tile of x and a 64-row tile of w in shared memory, and each unit of w is
 * used by 64 rows of x (each unit of x by 64 rows of w) before the next is loaded:
 *
 *     per K step of 2 units (64 elements) a thread block reads  64 x 2 x 40 B (x, quantized) + 64 x 2 x 20 B (w, Q4_1)
 *                                                  and computes  64 x 64 x 64 x 2 flops = 524,288
 *     arithmetic intensity: 524,288 / 7,680 B = 68 flops per byte from global memory or L2
 *     (Q8_0: 55, Q4_K: 71, Q6_K: 62), ~20-35x the GEMV route's; the weights are read ceil(M / 64) times, not M times.
 *
 * And the products are 8-bit integers: x is quantized once per step by `quantize_x` (the CPU twins' route:
 * llama.cpp's q8_1 blocks, kernels/cpu/qmatmul.c's struct xblock, the same rounding), and one dp4a instruction
 * (sm_61 and later) does 4 multiply-adds of signed bytes into an int32: 4 products where a float FMA does 1.
 *
 *   quantize_x:  x (M, K) float32 -> scratch (M, K / 32) xblocks {d, s, q[32]}:  d = max|x| / 127,
 *                q = rint(x * 127 / max|x|), s = d * sum(q);  one thread per xblock: grid ((K/32 + 127) / 128, M)
 *   qmatmul_tiled (grid (ceil(N / 64), ceil(M / 64)), 256 threads):
 *
 *          K steps of 2 units ->                          shared memory, per K step (double the units, same math)
 *        +--------+--------+--                            xq[2][8][64]  int8x4 words of x, word-major: a warp's
 *   x    | x tile | next   |     rows m0 .. m0+63                       16 threads read 16 consecutive rows
 *        +--------+--------+--                            xd, xs[2][64] each xblock's d and s
 *        +--------+--------+--                            wq[2][8][64]  int8x4 words of w's units, unpacked
 *   w    | w tile | next   |     rows n0 .. n0+63         wd, wd2, wc[2][64]  scale of elements 0-15, of 16-31,
 *        +--------+--------+--                                          and the constant term (see below)
 *
 *   thread t (16 x 16 of them): ty = t / 16, tx = t % 16 owns the 4 x 4 outputs
 *        out[m0 + ty + 16 i, n0 + tx + 16 j],  i, j in 0..3        (strided: a warp reads 16 consecutive wq
 *                                                                  words and 2 xq words, no bank conflict)
 *   per unit:  acc += d_x * (d_lo * dot(q_w[0..15], q_x[0..15]) + d_hi * dot(q_w[16..31], q_x[16..31])) + c * s_x
 *
 * Every format is a unit of 32 weights w = d_lo/hi * q_w + c / 32-element constant: Q4_0 q = nibble, c = -8 d;
 * Q4_1 c = m; Q5_0/Q5_1 the same with a fifth bit; Q8_0 c = 0; IQ4_NL/IQ4_XS q = the nibble's value, c = 0;
 * Q4_K/Q5_K d = d * sc, c = -dmin * mn; Q6_K q = q6 - 32, Q3_K q = q3 - 4, a scale per half (TWO_SCALES); Q2_K a
 * scale and a min per half (TWO_SCALES, TWO_MINS: x's q summed per half when staged, xs and xs2).
 * The integer sums are exact, so the result differs from float math only by x's rounding to 8 bits (half a step
 * per element), as on the CPU; the GEMV route (M <= 8) multiplies in float, so a row's result depends on which
 * side of the threshold its step's row count falls (llama.cpp's MMQ/MMVQ split, MMVQ_MAX_BATCH_SIZE 8, does the
 * same). Rows and columns past M and N are computed on zeros and not written.
 *
 * Needs from the including file: TV_M, TV_N, TV_K, WARP, ROW_BYTES, TWO_SCALES (TWO_MINS), and
 *   load_unit(w_row, u, q[8], d_lo, d_hi, c): unit u (elements 32u .. 32u + 31) of a row of w, as 8 words of
 *   4 signed bytes (word i: elements 4i .. 4i + 3) and its scales.
 * Arguments (row-major; qmatmul_tiled takes the GEMV route's four, quantize_x the middle two, scratch first):
 *   out:     (M, N)          float32, written
 *   scratch: (M, K / 32, 40) uint8: per block of 32 of x, float d | float s | int8 q[32]; written by quantize_x,
 *                            read by qmatmul_tiled
 *   x:       (M, K)          float32, read by quantize_x
 *   w:       (N, ROW_BYTES)  uint8, the GGUF's blocks, row after row
 */

#define QK_X 32                   /* elements per xblock */
#define NB (TV_K / QK_X)          /* xblocks (units) per row */
#define XBLOCK_BYTES 40           /* float d, float s, int8 q[32]: kernels/cpu/qmatmul.c's struct xblock */
#define TILE_M 64
#define TILE_N 64
#define TILE_UNITS 2              /* units of K per step */
#define THREADS 256
#define PER_THREAD 4              /* outputs per thread along m and along n: 4 x 4 */

#ifdef TV_QUANTIZE_X
TV_KERNEL __launch_bounds__(128)
quantize_x(unsigned char* __restrict__ scratch, const float* __restrict__ x) {
  const int b = blockIdx.x * 128 + threadIdx.x, m = blockIdx.y;
  if (b >= NB) return;
  const float4* xb = (const float4*)(x + (long)m * TV_K + b * QK_X);  /* (8,) float4 */
  float4 v[8];
  float amax = 0.0f;
  for (int i = 0; i < 8; i++) {
    v[i] = xb[i];
    amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[i].x), fabsf(v[i].y)), fmaxf(fabsf(v[i].z), fabsf(v[i].w))));
  }
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;  /* as the CPU: one division, then x * id */
  float* out = (float*)(scratch + ((long)m * NB + b) * XBLOCK_BYTES);  /* d, s, then q as 8 words */
  int sum = 0;
  for (int i = 0; i < 8; i++) {
    const int q0 = (int)rintf(v[i].x * id), q1 = (int)rintf(v[i].y * id);
    const int q2 = (int)rintf(v[i].z * id), q3 = (int)rintf(v[i].w * id);
    sum += q0 + q1 + q2 + q3;
    ((unsigned*)out)[2 + i] = (q0 & 0xFF) | (q1 & 0xFF) << 8 | (q2 & 0xFF) << 16 | (unsigned)(q3 & 0xFF) << 24;
  }
  out[0] = amax / 127.0f;
  out[1] = out[0] * (float)sum;
}
#endif

#ifdef TV_QMATMUL_TILED
TV_KERNEL __launch_bounds__(THREADS)
qmatmul_tiled(float* __restrict__ out, unsigned char* __restrict__ scratch, const float* __restrict__ x,
              const unsigned char* __restrict__ w) {
  __shared__ int xq[TILE_UNITS][8][TILE_M];
  __shared__ float xd[TILE_UNITS][TILE_M], xs[TILE_UNITS][TILE_M];
  __shared__ int wq[TILE_UNITS][8][TILE_N];
  __shared__ float wd[TILE_UNITS][TILE_N], wd2[TILE_UNITS][TILE_N], wc[TILE_UNITS][TILE_N];
#if TWO_MINS  /* a constant term per half unit: wc (elements 0-15) and wc2 (16-31), x's xs and xs2 the halves' sums */
  __shared__ float xs2[TILE_UNITS][TILE_M], wc2[TILE_UNITS][TILE_N];
#endif
  const int t = threadIdx.x, tx = t % 16, ty = t / 16;
  const int m0 = blockIdx.y * TILE_M, n0 = blockIdx.x * TILE_N;
  float acc[PER_THREAD][PER_THREAD];
  for (int i = 0; i < PER_THREAD; i++)
    for (int j = 0; j < PER_THREAD; j++) acc[i][j] = 0.0f;

  for (int u0 = 0; u0 < NB; u0 += TILE_UNITS) {
    /* stage: threads 0-127 one xblock each (row r, unit u0 + k), threads 128-255 one unit of w each */
    const int r = t % 64, k = t / 64 % TILE_UNITS, u = u0 + k;
    if (t < 128) {
      const int m = m0 + r;
      float d = 0.0f, s = 0.0f;
      unsigned q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (m < TV_M && u < NB) {
        const float* xb = (const float*)(scratch + ((long)m * NB + u) * XBLOCK_BYTES);
        d = xb[0];
        s = xb[1];
        for (int i = 0; i < 8; i++) q[i] = ((const unsigned*)xb)[2 + i];
      }
      for (int i = 0; i < 8; i++) xq[k][i][r] = (int)q[i];
      xd[k][r] = d;
#if TWO_MINS  /* d * the sum of q over elements 0-15, and over 16-31 */
      int lo = 0, hi = 0;
      for (int i = 0; i < 4; i++) {
        lo = __dp4a((int)q[i], 0x01010101, lo);
        hi = __dp4a((int)q[4 + i], 0x01010101, hi);
      }
      xs[k][r] = d * (float)lo;
      xs2[k][r] = d * (float)hi;
      (void)s;
#else
      xs[k][r] = s;
#endif
    } else {
      const int n = n0 + r;
      float d_lo = 0.0f, d_hi = 0.0f, c = 0.0f, c_hi = 0.0f;
      unsigned q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#if TWO_MINS
      if (n < TV_N && u < NB) load_unit(w + (long)n * ROW_BYTES, u, q, &d_lo, &d_hi, &c, &c_hi);
      wc2[k][r] = c_hi;
#else
      if (n < TV_N && u < NB) load_unit(w + (long)n * ROW_BYTES, u, q, &d_lo, &d_hi, &c);
      (void)c_hi;
#endif
      for (int i = 0; i < 8; i++) wq[k][i][r] = (int)q[i];
      wd[k][r] = d_lo;
      wd2[k][r] = d_hi;
      wc[k][r] = c;
    }
    __syncthreads();
    /* multiply: per unit, 8 words x 16 outputs = 128 dp4a, then the scales once per output */
    for (int k2 = 0; k2 < TILE_UNITS; k2++) {
      int lo[PER_THREAD][PER_THREAD], hi[PER_THREAD][PER_THREAD];
      for (int i = 0; i < PER_THREAD; i++)
        for (int j = 0; j < PER_THREAD; j++) lo[i][j] = hi[i][j] = 0;
      for (int word = 0; word < 8; word++) {
        int a[PER_THREAD], b[PER_THREAD];
        for (int i = 0; i < PER_THREAD; i++) a[i] = xq[k2][word][ty + 16 * i];
        for (int j = 0; j < PER_THREAD; j++) b[j] = wq[k2][word][tx + 16 * j];
        for (int i = 0; i < PER_THREAD; i++)
          for (int j = 0; j < PER_THREAD; j++) {
            if (word < 4) lo[i][j] = __dp4a(a[i], b[j], lo[i][j]);
            else hi[i][j] = __dp4a(a[i], b[j], hi[i][j]);
          }
      }
      for (int i = 0; i < PER_THREAD; i++) {
        const float dx = xd[k2][ty + 16 * i], sx = xs[k2][ty + 16 * i];
#if TWO_MINS
        const float sx2 = xs2[k2][ty + 16 * i];
#endif
        for (int j = 0; j < PER_THREAD; j++) {
          const int n = tx + 16 * j;
#if TWO_SCALES
          const float dot = fmaf(wd[k2][n], (float)lo[i][j], wd2[k2][n] * (float)hi[i][j]);
#else
          const float dot = wd[k2][n] * (float)(lo[i][j] + hi[i][j]);
#endif
#if TWO_MINS
          acc[i][j] = fmaf(dx, dot, fmaf(wc[k2][n], sx, fmaf(wc2[k2][n], sx2, acc[i][j])));
#else
          acc[i][j] = fmaf(dx, dot, fmaf(wc[k2][n], sx, acc[i][j]));
#endif
        }
      }
    }
    __syncthreads();  /* every thread is done with this step's tiles before they are overwritten */
  }
  for (int i = 0; i < PER_THREAD; i++)
    for (int j = 0; j < PER_THREAD; j++) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < TV_M && n < TV_N) out[(long)m * TV_N + n] = acc[i][j];
    }
}
#endif
