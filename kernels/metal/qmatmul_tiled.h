/* The quantized matmul for many rows of x (M > 8): output tiles of 64 x 64 staged through threadgroup memory,
 * integer dot products on x quantized to 8 bits. Included by qmatmul.metal and qmatmul_k.metal, which give it the
 * weights' unpacking (`load_unit`); the twin of kernels/cuda/qmatmul_tiled.cuh, whose header explains the tiling
 * and its arithmetic intensity (68 flops per byte read for Q4_1, against 3.2 for the GEMV route). The layout and the
 * index math are the same line for line; Metal has no dp4a, so `dot4` does the 4 byte products in int arithmetic.
 *
 *   quantize_x:     x (M, K) float32 -> scratch (M, K / 32) xblocks {d, s, q[32]} (kernels/cpu/qmatmul.c's struct
 *                   xblock, the same rounding); one thread per xblock: grid ((K/32 + 127) / 128, M), 128 threads
 *   qmatmul_tiled:  grid (ceil(N / 64), ceil(M / 64)), 256 threads; thread (ty, tx) = (t / 16, t % 16) owns
 *                   out[m0 + ty + 16 i, n0 + tx + 16 j], i, j in 0..3
 *
 * Needs from the including file: TV_M, TV_N, TV_K, ROW_BYTES, TWO_SCALES (TWO_MINS), and
 *   load_unit(w_row, u, q[8], d_lo, d_hi, c): unit u (elements 32u .. 32u + 31) of a row of w, as 8 words of
 *   4 signed bytes (word i: elements 4i .. 4i + 3), w = d_lo * q + c (elements 0-15), d_hi * q + c (16-31).
 * Arguments (row-major; qmatmul_tiled takes the GEMV route's four, quantize_x the middle two, scratch first):
 *   out:     (M, N)          float32, written
 *   scratch: (M, K / 32, 40) uint8: per block of 32 of x, float d | float s | int8 q[32]; written by quantize_x,
 *                            read by qmatmul_tiled
 *   x:       (M, K)          float32, read by quantize_x
 *   w:       (N, ROW_BYTES)  uint8, the GGUF's blocks, row after row
 */

#define QK_X 32                   /* elements per xblock */
#define NB (TV_K / QK_X)          /* xblocks (units) per row */
#define XBLOCK_BYTES 40           /* float d, float s, int8 q[32] */
#define TILE_M 64
#define TILE_N 64
#define TILE_UNITS 2              /* units of K per step */
#define THREADS 256
#define PER_THREAD 4              /* outputs per thread along m and along n: 4 x 4 */

/* byte i of w as a signed value: shifted to the top as unsigned, then arithmetic-shifted back (sign-extended) */
inline int sbyte(int w, int i) { return int(uint(w) << (24 - 8 * i)) >> 24; }

/* the 4 signed bytes of a times those of b, added to c (CUDA's __dp4a) */
inline int dot4(int a, int b, int c) {
  for (int i = 0; i < 4; i++) c += sbyte(a, i) * sbyte(b, i);
  return c;
}

#ifdef TV_QUANTIZE_X
TV_KERNEL quantize_x(device uchar* scratch [[buffer(0)]], const device float* x [[buffer(1)]],
                     uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  const int b = gid.x * 128 + lid.x, m = gid.y;
  if (b >= NB) return;
  const device float4* xb = (const device float4*)(x + (long)m * TV_K + b * QK_X);  /* (8,) float4 */
  float4 v[8];
  float amax = 0.0f;
  for (int i = 0; i < 8; i++) {
    v[i] = xb[i];
    amax = max(amax, max(max(fabs(v[i].x), fabs(v[i].y)), max(fabs(v[i].z), fabs(v[i].w))));
  }
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;  /* as the CPU: one division, then x * id */
  device float* out = (device float*)(scratch + ((long)m * NB + b) * XBLOCK_BYTES);  /* d, s, then q as 8 words */
  int sum = 0;
  for (int i = 0; i < 8; i++) {
    const int q0 = int(rint(v[i].x * id)), q1 = int(rint(v[i].y * id));
    const int q2 = int(rint(v[i].z * id)), q3 = int(rint(v[i].w * id));
    sum += q0 + q1 + q2 + q3;
    ((device uint*)out)[2 + i] = (q0 & 0xFF) | (q1 & 0xFF) << 8 | (q2 & 0xFF) << 16 | uint(q3 & 0xFF) << 24;
  }
  out[0] = amax / 127.0f;
  out[1] = out[0] * float(sum);
}
#endif

#ifdef TV_QMATMUL_TILED
TV_KERNEL qmatmul_tiled(device float* out [[buffer(0)]], device uchar* scratch [[buffer(1)]],
                        const device float* x [[buffer(2)]], const device uchar* w [[buffer(3)]],
                        uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  threadgroup int xq[TILE_UNITS][8][TILE_M];
  threadgroup float xd[TILE_UNITS][TILE_M], xs[TILE_UNITS][TILE_M];
  threadgroup int wq[TILE_UNITS][8][TILE_N];
  threadgroup float wd[TILE_UNITS][TILE_N], wd2[TILE_UNITS][TILE_N], wc[TILE_UNITS][TILE_N];
#if TWO_MINS  /* a constant term per half unit: wc (elements 0-15) and wc2 (16-31), x's xs and xs2 the halves' sums */
  threadgroup float xs2[TILE_UNITS][TILE_M], wc2[TILE_UNITS][TILE_N];
#endif
  const int t = lid.x, tx = t % 16, ty = t / 16;
  const int m0 = gid.y * TILE_M, n0 = gid.x * TILE_N;
  float acc[PER_THREAD][PER_THREAD];
  for (int i = 0; i < PER_THREAD; i++)
    for (int j = 0; j < PER_THREAD; j++) acc[i][j] = 0.0f;

  for (int u0 = 0; u0 < NB; u0 += TILE_UNITS) {
    /* stage: threads 0-127 one xblock each (row r, unit u0 + k), threads 128-255 one unit of w each */
    const int r = t % 64, k = t / 64 % TILE_UNITS, u = u0 + k;
    if (t < 128) {
      const int m = m0 + r;
      float d = 0.0f, s = 0.0f;
      uint q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (m < TV_M && u < NB) {
        const device float* xb = (const device float*)(scratch + ((long)m * NB + u) * XBLOCK_BYTES);
        d = xb[0];
        s = xb[1];
        for (int i = 0; i < 8; i++) q[i] = ((const device uint*)xb)[2 + i];
      }
      for (int i = 0; i < 8; i++) xq[k][i][r] = int(q[i]);
      xd[k][r] = d;
#if TWO_MINS  /* d * the sum of q over elements 0-15, and over 16-31 */
      int lo = 0, hi = 0;
      for (int i = 0; i < 4; i++) {
        lo = dot4(int(q[i]), 0x01010101, lo);
        hi = dot4(int(q[4 + i]), 0x01010101, hi);
      }
      xs[k][r] = d * float(lo);
      xs2[k][r] = d * float(hi);
      (void)s;
#else
      xs[k][r] = s;
#endif
    } else {
      const int n = n0 + r;
      float d_lo = 0.0f, d_hi = 0.0f, c = 0.0f, c_hi = 0.0f;
      uint q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#if TWO_MINS
      if (n < TV_N && u < NB) load_unit(w + (long)n * ROW_BYTES, u, q, d_lo, d_hi, c, c_hi);
      wc2[k][r] = c_hi;
#else
      if (n < TV_N && u < NB) load_unit(w + (long)n * ROW_BYTES, u, q, d_lo, d_hi, c);
#endif
      for (int i = 0; i < 8; i++) wq[k][i][r] = int(q[i]);
      wd[k][r] = d_lo;
      wd2[k][r] = d_hi;
      wc[k][r] = c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    /* multiply: per unit, 8 words x 16 outputs = 128 dot4, then the scales once per output */
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
            if (word < 4) lo[i][j] = dot4(a[i], b[j], lo[i][j]);
            else hi[i][j] = dot4(a[i], b[j], hi[i][j]);
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
          const float dot = fma(wd[k2][n], float(lo[i][j]), wd2[k2][n] * float(hi[i][j]));
#else
          const float dot = wd[k2][n] * float(lo[i][j] + hi[i][j]);
#endif
#if TWO_MINS
          acc[i][j] = fma(dx, dot, fma(wc[k2][n], sx, fma(wc2[k2][n], sx2, acc[i][j])));
#else
          acc[i][j] = fma(dx, dot, fma(wc[k2][n], sx, acc[i][j]));
#endif
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  /* every thread is done with this step's tiles */
  }
  for (int i = 0; i < PER_THREAD; i++)
    for (int j = 0; j < PER_THREAD; j++) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < TV_M && n < TV_N) out[(long)m * TV_N + n] = acc[i][j];
    }
}
#endif
