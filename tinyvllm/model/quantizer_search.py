"""The quantizers that search for their scales: IQ4_NL and Q4_K, with numpy (Phase 6).

Q8_0, Q4_0 and Q4_1 take their scale from the block's extremes (quantizer.py). IQ4_NL and Q4_K try several
scales per block and keep the one whose weighted squared error is least; these are ggml's own searches
(ggml/src/ggml-quants.c: `quantize_iq4_nl` with its 15 tries, which llama-quantize runs, and `quantize_row_q4_K_ref`
with `make_qkx2_quants`' 21 steps), written with the same float32 operations in the same order, so the bytes equal
llama-quantize's (tests/test_quantize.py holds digests of ggml's output).

ggml loops over a block's elements, summing as it goes; here every block of a chunk is worked on at once with the
chunk transposed, (elements, blocks): each of ggml's sequential sums becomes a loop over the rows, one vector add per
element, which adds in ggml's order (numpy's own reductions add pairwise, another order, other last bits).
"""

from __future__ import annotations

import numpy as np

from tinyvllm.model.quant import IQ4NL_VALUES

_VALUES = IQ4NL_VALUES.astype(np.float32)  # (16,) the grid IQ4_NL's nibbles index, ascending


def sequential_sum(a: np.ndarray) -> np.ndarray:
    """a (k, n) float32 -> (n,): a[0] + a[1] + ... + a[k-1] in that order, as a C loop `s += a[j]` adds."""
    s = a[0].copy()
    for row in a[1:]:
        s += row
    return s


# The values are whole numbers, so which of them lie at or below x depends only on floor(x): per floor(x) in
# -128..114 (x clipped there first), mu = the index of the first value above x (clipped to 1..15), and the two
# candidates values[mu - 1], values[mu]. One table lookup replaces ggml's bisection.
_FLOORS = np.arange(-128, 115, dtype=np.float32)
_MU = np.clip(np.searchsorted(_VALUES, _FLOORS, side="right"), 1, 15).astype(np.int8)
_BELOW, _ABOVE = _VALUES[_MU - 1], _VALUES[_MU]


def nearest_value(x: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 on IQ4NL_VALUES: the index of the value nearest x (float32, any shape), ties upward.

    ggml bisects to mu, the first value above x, then keeps mu - 1 if x - values[mu-1] < values[mu] - x, both
    differences rounded to float32 (so near a midpoint the rounding decides, as it does in C); below values[0] or
    above values[15] that gives 0 or 15, as ggml's early returns."""
    at = np.floor(x)
    np.clip(at, -128, 114, out=at)
    at += 128
    i = at.astype(np.intp)  # (numpy would convert any other index type on each of the three lookups)
    return _MU[i] - ((x - _BELOW[i]) < (_ABOVE[i] - x))


def _weighted_sums(xt: np.ndarray, weight: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sum_j w q x and sum_j w q q over each block (columns), q = values[idx]: ggml's sumqx, sumq2."""
    q = _VALUES[idx]
    wq = weight * q
    return sequential_sum(wq * xt), sequential_sum(wq * q)


def quantize_iq4_nl(x: np.ndarray, out: np.ndarray, ntry: int = 7) -> None:
    """x (n, 32) float32 -> out (n, 18) uint8: f16 d, then 16 bytes of nibbles indexing IQ4NL_VALUES.

    ggml's quantize_row_iq4_nl_impl for one block of 32 without an importance matrix (weights x^2):
      1. d = max / 127 (max: the element of largest |x|, sign kept), each x to its nearest value of x / d, and the
         least-squares scale of that assignment, d = sum w q x / sum w q^2;
      2. ntry > 0: 2 ntry + 1 more assignments from the scales max / (itry - 127), itry = -ntry..ntry, each kept if
         its least-squares fit is better (sumqx^2 / sumq2 larger), then every x assigned once more with the scale
         found. ntry = 7 is what llama-quantize runs (`quantize_iq4_nl`); ggml's quantize_row_iq4_nl_ref passes -1,
         which skips step 2 and keeps step 1's assignment (a block of zeros then gets whatever ggml's stack held: here
         nibble 8, value 1, times d = 0)."""
    xt = np.ascontiguousarray(x.T)  # (32, n)
    n = xt.shape[1]
    weight = xt * xt
    cols = np.arange(n)
    first = np.abs(xt).argmax(axis=0)  # the first element of largest |x|, as ggml's strict `>` finds it
    mx, amax = xt[first, cols], np.abs(xt[first, cols])
    live = amax >= np.float32(1e-15)  # GROUP_MAX_EPS: below it the block's scale is 0
    safe_mx = np.where(live, mx, np.float32(1))
    with np.errstate(all="ignore"):  # (a NaN or an overflow shows in d: the caller checks it)
        d = (-safe_mx if ntry > 0 else safe_mx) / np.float32(-127)
        idx = nearest_value((np.float32(1) / d) * xt)
        sumqx, sumq2 = _weighted_sums(xt, weight, idx)
        d = np.where(sumq2 > 0, sumqx / sumq2, np.float32(0)).astype(np.float32)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            sumqx, sumq2 = _weighted_sums(xt, weight, nearest_value((np.float32(itry - 127) / safe_mx) * xt))
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
        d = np.where(live, d, np.float32(0))
        if ntry > 0:  # every x once more, with the scale found (in float32, before its rounding to float16)
            idx = nearest_value(np.where(d != 0, np.float32(1) / d, np.float32(0)) * xt)
        else:
            idx = np.where(live, idx, 8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    idx = idx.astype(np.uint8)
    out[:, 2:] = (idx[:16] | (idx[16:] << 4)).T
