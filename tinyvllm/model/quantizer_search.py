"""The quantizers that search for their scales, IQ4_NL and Q4_K, with numpy (docs/phases/06-appendix-formats.md)."""

from __future__ import annotations

import numpy as np

from tinyvllm.model.quant import IQ4NL_VALUES

_VALUES = IQ4NL_VALUES.astype(np.float32)  # (16,) ascending


def sequential_sum(a: np.ndarray) -> np.ndarray:
    """a (k, n) float32 -> (n,) summed in order, as a C loop `s += a[j]` adds."""
    s = a[0].copy()
    for row in a[1:]:
        s += row
    return s


# the midpoints between neighbouring values are half-integers: the nearest value depends only on floor(2 x)
_TWICE_MIDPOINTS = _VALUES[:-1] + _VALUES[1:]  # (15,)
_LOWEST, _HIGHEST = -256, 228
_NEAREST = np.searchsorted(_TWICE_MIDPOINTS, np.arange(_LOWEST, _HIGHEST + 1, dtype=np.float32), side="right")


def nearest_value(x: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 on IQ4NL_VALUES: the index nearest x (any shape), ties upward."""
    at = np.floor(x * np.float32(2))
    np.clip(at, _LOWEST, _HIGHEST, out=at)
    at -= _LOWEST
    return _NEAREST[at.astype(np.intp)]


def _weighted_sums(xt: np.ndarray, weight: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's sumqx, sumq2 over each block (column), q = values[idx]."""
    q = _VALUES[idx]
    wq = weight * q
    return sequential_sum(wq * xt), sequential_sum(wq * q)


def quantize_iq4_nl(x: np.ndarray, out: np.ndarray, ntry: int = 7) -> None:
    """x (n, 32) float32 -> out (n, 18) uint8: f16 d, then 16 bytes of nibbles."""
    xt = np.ascontiguousarray(x.T)  # (32, n)
    n = xt.shape[1]
    weight = xt * xt
    cols = np.arange(n)
    first = np.abs(xt).argmax(axis=0)  # the first largest |x|, as ggml's strict `>`
    mx, amax = xt[first, cols], np.abs(xt[first, cols])
    live = amax >= np.float32(1e-15)  # GROUP_MAX_EPS: below it the block's scale is 0
    safe_mx = np.where(live, mx, np.float32(1))
    with np.errstate(all="ignore"):  # a NaN or overflow shows in d: the caller checks it
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
        if ntry > 0:  # once more with the float32 scale found
            idx = nearest_value(np.where(d != 0, np.float32(1) / d, np.float32(0)) * xt)
        else:
            idx = np.where(live, idx, 8)
        out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    idx = idx.astype(np.uint8)
    out[:, 2:] = (idx[:16] | (idx[16:] << 4)).T


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (its float trick is rint below 2^22)."""
    return np.rint(v)


def _make_qkx2_quants(xt: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants(32, 15, ..., rmin -1, rdelta 0.1, nstep 20) on every sub-block: xt, weights (32, n)."""
    n = xt.shape[1]
    mn, mx = xt.min(axis=0), xt.max(axis=0)
    sum_w = sequential_sum(weights)
    sum_x = sequential_sum(weights * xt)
    mn = np.minimum(mn, np.float32(0))
    flat = mx == mn
    span = np.where(flat, np.float32(1), mx - mn)
    iscale = np.float32(15) / span
    scale = np.float32(1) / iscale
    L = np.clip(_nearest_int(iscale * (xt - mn)), 0, 15)
    diff = (scale * L + mn) - xt
    best_error = sequential_sum(weights * (diff * diff))
    for step in range(21):  # as in ggml, a better fit's min moves the next steps' grid
        span = np.where(flat, np.float32(1), mx - mn)
        iscale = ((np.float32(-1) + np.float32(0.1) * np.float32(step)) + np.float32(15)) / span
        laux = np.clip(_nearest_int(iscale * (xt - mn)), 0, 15)
        wl = weights * laux
        sum_l, sum_l2, sum_xl = sequential_sum(wl), sequential_sum(wl * laux), sequential_sum(wl * xt)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        safe_d = np.where(ok, D, np.float32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_d
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_d
        positive = this_min > 0
        this_min = np.where(positive, np.float32(0), this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 != 0, sum_l2, np.float32(1)), this_scale)
        diff = (this_scale * laux + this_min) - xt
        cur_error = sequential_sum(weights * (diff * diff))
        better = ok & (cur_error < best_error)
        L = np.where(better, laux, L)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    L = np.where(flat, np.float32(0), L)
    scale = np.where(flat, np.float32(0), scale)
    return L, scale, -mn


def quantize_q4_k(x: np.ndarray, out: np.ndarray) -> None:
    """x (n, 256) float32 -> out (n, 144) uint8 Q4_K blocks, as ggml's quantize_row_q4_K_ref."""
    n = x.shape[0]
    xt = np.ascontiguousarray(x.reshape(n * 8, 32).T)  # (32, 8n): sub-block b = column b
    with np.errstate(all="ignore"):
        av_x = np.sqrt(sequential_sum(xt * xt) / np.float32(32))
        L, scales, mins = _make_qkx2_quants(xt, av_x + np.abs(xt))
        scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
        max_scale = np.maximum(scales.max(axis=1), np.float32(0))  # ggml's running max, from 0
        max_min = np.maximum(mins.max(axis=1), np.float32(0))
        inv_scale = np.where(max_scale > 0, np.float32(63) / np.where(max_scale > 0, max_scale, 1), np.float32(0))
        inv_min = np.where(max_min > 0, np.float32(63) / np.where(max_min > 0, max_min, 1), np.float32(0))
        # (uint8_t): a negative value wraps past 63, and MIN(63, .) makes it 63
        ls = np.minimum(_nearest_int(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
        lm = np.minimum(_nearest_int(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
        d16 = (max_scale / np.float32(63)).astype(np.float16)
        dmin16 = (max_min / np.float32(63)).astype(np.float16)
        d = d16.astype(np.float32)[:, None] * ls.astype(np.float32)  # (n, 8) stored scales
        dm = dmin16.astype(np.float32)[:, None] * lm.astype(np.float32)
        again = _nearest_int((xt + dm.reshape(1, -1)) / np.where(d != 0, d, np.float32(1)).reshape(1, -1))
        L = np.where(d.reshape(1, -1) != 0, np.clip(again, 0, 15), L)
        q = L.T.reshape(n, 4, 2, 32).astype(np.uint8)  # (n, chunk c, sub-block 2c or 2c + 1, element)
    out[:, 0:2] = d16.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = dmin16.view(np.uint8).reshape(n, 2)
    # 6-bit scales and mins: quant.py's _k_scales_mins draws the packing
    out[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 12:16] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
