/* The register tiles shared by the CPU matmuls (matmul.c, qmatmul.c, qmatmul_k.c): an output tile is mr rows of x
 * times nr rows of w, mr and nr constants at every call site, so clang unrolls the tile's loops and keeps its
 * accumulators in registers. The including file defines TV_M and TV_N, MR and NR (the largest tile), MB (rows of x
 * per pass over a chunk) and CHUNK_ROWS (rows of w per chunk).
 *
 * The loops are macros over the including file's own tile function (its x and w are float32 rows, quantized blocks
 * or super-blocks): each expansion is the loop that file would write out by hand, the same machine code.
 * Everything is TV_INLINE (always inlined): a kernel's entry must stay the first function of its object.
 */
#ifndef TV_TILE_H
#define TV_TILE_H

/* 8 floats in one AVX2 register; aligned(4) makes loads through it unaligned loads (rows of w start at any
 * multiple of K floats). With -march=native clang turns `acc += a * b` into one FMA. */
typedef float f8 __attribute__((vector_size(32), aligned(4)));

/* the 8 lanes' sum, halving: (0..3 + 4..7), then pairs, then the last two (qdot.h's hsum8 is the AVX2 twin) */
TV_INLINE float hsum_f8(f8 v) {
  typedef float f4 __attribute__((vector_size(16)));
  f4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  a = a + __builtin_shufflevector(a, a, 2, 3, 0, 1);
  a = a + __builtin_shufflevector(a, a, 1, 0, 3, 2);
  return a[0];
}

/* out[i, j] = dot(x[i, :], w[j, :]) for i < mr, j < nr over float32 rows of TV_K (row stride TV_K, out's TV_N).
 * Each vector of w is loaded once and used mr times, each vector of x nr times. With `prefetch` (a constant) the
 * next tile's rows of w (NR further on) are prefetched: past the last row that is a harmless no-op. */
TV_INLINE void float_tile(float* restrict out, const float* restrict x, const float* restrict w, int mr, int nr,
                          int prefetch) {
  f8 acc[MR][NR];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = (f8){0};
  int k = 0;
  for (; k + 8 <= TV_K; k += 8) {
    f8 wv[NR];
    for (int j = 0; j < nr; j++) wv[j] = *(const f8*)(w + j * TV_K + k);
    if (prefetch)
      for (int j = 0; j < nr; j++) __builtin_prefetch(w + (NR + j) * TV_K + k, 0, 3);
    for (int i = 0; i < mr; i++) {
      f8 xv = *(const f8*)(x + i * TV_K + k);
      for (int j = 0; j < nr; j++) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      float s = hsum_f8(acc[i][j]);
      for (int kk = k; kk < TV_K; kk++) s += x[i * TV_K + kk] * w[j * TV_K + kk];  /* K % 8 leftover */
      out[i * TV_N + j] = s;
    }
}

/* In TV_TILE_COLUMN_FN's function (its arguments out, x, w, n, m0, m1, nr): rows m0..m1 of x against the tiles of
 * column n, TILE(out + m * TV_N + n, x + m * x_row, w + n * w_row, mr, nr) for
 * m = m0, m0 + MR, ..., the last (m1 - m0) % MR rows as one shorter tile whose mr is a constant per case (each case
 * its own unrolled tile; a case of MR rows or more is never taken and compiles to nothing). */
#define TV_TILE_AT(TILE, mr, x_row, w_row) TILE(out + m_ * TV_N + n, x + m_ * (x_row), w + n * (w_row), mr, nr)
#define TV_TILE_COLUMN(TILE, x_row, w_row)                                         \
  do {                                                                              \
    int m_ = m0;                                                                    \
    for (; m_ + MR <= m1; m_ += MR) TV_TILE_AT(TILE, MR, x_row, w_row);                           \
    switch (m1 - m_) {                                                              \
      case 7: if (MR > 7) TV_TILE_AT(TILE, 7, x_row, w_row); break;                               \
      case 6: if (MR > 6) TV_TILE_AT(TILE, 6, x_row, w_row); break;                               \
      case 5: if (MR > 5) TV_TILE_AT(TILE, 5, x_row, w_row); break;                               \
      case 4: if (MR > 4) TV_TILE_AT(TILE, 4, x_row, w_row); break;                               \
      case 3: if (MR > 3) TV_TILE_AT(TILE, 3, x_row, w_row); break;                               \
      case 2: if (MR > 2) TV_TILE_AT(TILE, 2, x_row, w_row); break;                               \
      case 1: if (MR > 1) TV_TILE_AT(TILE, 1, x_row, w_row); break;                               \
      default: break;                                                               \
    }                                                                               \
  } while (0)

/* Defines `name(out, x, w, n, m0, m1, nr)`: rows m0..m1 of x against rows n..n+nr of w (x_t rows of x_row elements,
 * w_t rows of w_row) by TV_TILE_COLUMN. A function of its own, not a loop pasted into the chunk: its restrict
 * arguments tell clang that the tiles' stores never touch x or w (the same machine code as a hand-written one). */
#define TV_TILE_COLUMN_FN(name, TILE, x_t, x_row, w_t, w_row)                                                \
  TV_INLINE void name(float* restrict out, const x_t* restrict x, const w_t* restrict w, int n, int m0, int m1, \
                      int nr) {                                                                               \
    TV_TILE_COLUMN(TILE, x_row, w_row);                                                                       \
  }

/* One chunk of the work: output columns [n0, n1) (n0 = chunk * CHUNK_ROWS, n1 = TV_CHUNK_END) for every row of x,
 * MB rows of x at a time (they stay in L2 while the chunk's rows of w are read from L1), NR rows of w per column of
 * tiles, then the N % NR leftover rows one at a time: COLUMN(out, x, w, n, m0, m1, nr), from TV_TILE_COLUMN_FN. */
#define TV_CHUNK_END(chunk) ((chunk) * CHUNK_ROWS + CHUNK_ROWS < TV_N ? (chunk) * CHUNK_ROWS + CHUNK_ROWS : TV_N)
#define TV_CHUNK_COLUMNS(COLUMN, chunk, out, x, w)                                  \
  do {                                                                              \
    int n0_ = (chunk) * CHUNK_ROWS, n1_ = TV_CHUNK_END(chunk);                      \
    for (int m0_ = 0; m0_ < TV_M; m0_ += MB) {                                      \
      int m1_ = m0_ + MB < TV_M ? m0_ + MB : TV_M;                                  \
      int n_ = n0_;                                                                 \
      for (; n_ + NR <= n1_; n_ += NR) COLUMN((out), (x), (w), n_, m0_, m1_, NR);   \
      for (; n_ < n1_; n_++) COLUMN((out), (x), (w), n_, m0_, m1_, 1);              \
    }                                                                               \
  } while (0)

#endif  /* TV_TILE_H */
