"""The chapters' figures, drawn from the engine's own code: `python docs/images/draw_figures.py` rewrites them.

Each figure runs the part of tinyvllm it shows and draws what that part returned, so a figure cannot disagree
with the engine: the block tables are `BlockManager`'s, the schedule is `Scheduler`'s step by step, the
flattened batch is what `ModelRunner.compute_logits` hands its graph, the online softmax is computed here and
checked against the plain one, and the tensor-parallel split is `TensorParallel`'s rows of SmolLM2's config.

    figure                 chapter                                  drawn from
    block-table.svg        docs/phases/02-paged-attention.md        BlockManager.allocate / append_slots
    schedule.svg           docs/phases/03-continuous-batching.md    Scheduler.schedule / update_from_output
    flattened-batch.svg    docs/phases/04-batched-forward.md        ModelRunner.compute_logits' inputs
    online-softmax.svg     docs/phases/05-custom-kernels.md         numpy, the kernels' update rule
    tp-split.svg           docs/phases/08-multi-device.md           TensorParallel.fused_rows, ModelConfig

The runs are in `figure_runs.py`, the SVG primitives in `svg.py` (plain rectangles, lines and text written by
hand; no plotting library), with fixed number formatting, so the output is the same bytes on every run;
`tests/test_figures.py` redraws each figure and
compares it with the file. Elements that carry the engine's data have an `id` or `class` (`table-A`,
`cell`), which the test reads back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

IMAGES = Path(__file__).resolve().parent
sys.path.insert(0, str(IMAGES))  # its two modules, beside it, also when the file is loaded by path (the test)

from figure_runs import (  # noqa: E402  (the engine's runs, and the figures' inputs the test reads back)
    SCHEDULE_LIMITS, SCHEDULE_REQUESTS, SCORES, TILE, VALUES, block_table_run, flattened_step, online_softmax,
    schedule_trace, tp_layout)
from svg import FILLS, GREY, HIGHLIGHT, INK, LIGHT, STROKES, Svg  # noqa: E402


# ---- 1. block tables (chapter 02, section 2) ----

def draw_block_table() -> str:
    bm, seqs = block_table_run()
    size = bm.block_size
    svg = Svg(520, "Block tables: each sequence's positions mapped to blocks of one pool")
    svg.text(20, 28, "Block tables map a sequence's positions to blocks anywhere in one pool", size=17, bold=True)
    svg.text(20, 50, f"BlockManager(num_blocks={bm.num_blocks}, block_size={size}) after chapter 02's steps: "
             + ", ".join(f"{name} has {seq.num_computed_tokens} tokens computed" for name, seq in seqs.items()),
             size=13, fill=GREY)

    # the pool, on the right: one row per physical block, one box per slot
    pool_x, pool_y, row_h, slot_w = 590, 84, 42, 56
    owner = {block: i for i, seq in enumerate(seqs.values()) for block in seq.block_table}
    written = {}  # slot -> "a5": the token whose K/V the slot holds
    for name, seq in seqs.items():
        for pos, slot in enumerate(bm.get_slot_mapping(seq, 0, seq.num_computed_tokens)):
            written[slot] = f"{name.lower()}{pos}"
    svg.text(pool_x - 80, pool_y - 14, "the pool (slot numbers in grey)", size=14, bold=True)
    free = {block.block_id for block in bm.free_block_queue}
    svg.group("pool", {"written": " ".join(f"{slot}:{token}" for slot, token in sorted(written.items())),
                       "free": " ".join(map(str, sorted(free)))})
    row_y = {}
    for block in range(bm.num_blocks):
        y = pool_y + block * row_h
        row_y[block] = y + 18
        svg.text(pool_x - 8, y + 23, f"block {block}", size=14, anchor="end")
        who = owner.get(block)
        for offset in range(size):
            slot = block * size + offset
            fill, stroke = (LIGHT, "#999999") if who is None else (FILLS[who], STROKES[who])
            if who is not None and slot not in written:
                fill = "#ffffff"  # held by the sequence, its token not computed yet
            svg.rect(pool_x + offset * slot_w, y, slot_w - 4, 36, fill, stroke)
            svg.text(pool_x + offset * slot_w + 26, y + 19, written.get(slot, ""), size=15, anchor="middle", mono=True)
            svg.text(pool_x + offset * slot_w + 49, y + 32, str(slot), size=11, anchor="end", fill=GREY)
        if block in free:
            svg.text(pool_x + size * slot_w + 2, y + 23, "free", size=13, fill=GREY)
    svg.end_group()

    # each sequence on the left: its positions, grouped into logical blocks, and its block table
    for i, (name, seq) in enumerate(seqs.items()):
        y0 = 100 + i * 190
        n = seq.num_computed_tokens
        svg.text(20, y0, f"sequence {name}: {n} tokens computed", size=15, bold=True)
        for pos in range(n):
            x = 20 + pos * 40 + (pos // size) * 12
            stroke, width = (HIGHLIGHT, 3) if (name, pos) == ("A", 5) else (STROKES[i], 1)
            svg.rect(x, y0 + 12, 36, 32, FILLS[i], stroke, width)
            svg.text(x + 18, y0 + 33, f"{name.lower()}{pos}", size=14, anchor="middle", mono=True)
        for logical in range(len(seq.block_table)):
            x = 20 + logical * (size * 40 + 12)
            svg.text(x, y0 + 62, f"logical block {logical}", size=12, fill=GREY)
        svg.text(396, y0, "block_table", size=14, mono=True)
        svg.group(f"table-{name}", {"entries": " ".join(map(str, seq.block_table))})
        for logical, block in enumerate(seq.block_table):
            y = y0 + 12 + logical * 42
            svg.text(400, y + 22, f"[{logical}]", size=13, anchor="end", mono=True, fill=GREY)
            svg.rect(404, y, 46, 34, "#ffffff", STROKES[i], 2)
            svg.text(427, y + 23, str(block), size=16, anchor="middle", bold=True)
            svg.curve(450, y + 17, pool_x - 74, row_y[block], STROKES[i])
        svg.end_group()

    # one token's slot, worked out
    a = seqs["A"]
    pos = 5
    block, offset = a.block_table[pos // size], pos % size
    (slot,) = bm.get_slot_mapping(a, pos, pos + 1)
    assert slot == block * size + offset, "the figure's formula is not the block manager's"
    hx = pool_x + offset * slot_w
    svg.rect(hx, pool_y + block * row_h, slot_w - 4, 36, "none", HIGHLIGHT, 3)
    svg.text(20, 460, f"A, position {pos}:  slot = block_table[{pos} // {size}] * {size} + {pos} % {size}"
             f"  =  {block} * {size} + {offset}  =  {slot}", size=15, mono=True, fill=HIGHLIGHT)
    svg.legend(20, 498, [(FILLS[0], STROKES[0], "A's blocks"), (FILLS[1], STROKES[1], "B's blocks"),
                         ("#ffffff", STROKES[0], "a slot held, not yet written"),
                         (LIGHT, "#999999", "in the free block queue")])
    return svg.render()


# ---- 2. the schedule over time (chapter 03) ----

STATES = {  # state -> (fill, stroke, legend)
    "prefill": ("#9ecae1", "#3182bd", "prefill chunk"),
    "decode": ("#a1d99b", "#31a354", "decode"),
    "waiting": (LIGHT, "#aaaaaa", "waiting"),
    "preempted": ("#fb6a4a", "#a50f15", "preempted"),
    "finished": ("#ffffff", "#cccccc", "finished"),
}


def draw_schedule() -> str:
    steps, totals = schedule_trace()
    lim = SCHEDULE_LIMITS
    label_w, cell_w, cell_h, top = 230, 55, 46, 104
    svg = Svg(top + len(SCHEDULE_REQUESTS) * (cell_h + 6) + 156, "The scheduler's steps: who computes how many tokens")
    svg.text(20, 28, "Continuous batching, step by step: the Scheduler's own plan", size=17, bold=True)
    svg.text(20, 50, f"max_num_batched_tokens = {lim['max_num_batched_tokens']}, a pool of {lim['num_blocks']} "
             f"blocks of {lim['block_size']} tokens; each cell: the tokens the step computes for the request",
             size=13, fill=GREY)
    for step in range(len(steps)):
        svg.text(label_w + step * cell_w + cell_w / 2, top - 12, str(step), size=14, anchor="middle", bold=True)
    svg.text(label_w - 10, top - 12, "step", size=14, anchor="end", bold=True)
    for r, (name, prompt_len, max_tokens, at) in enumerate(SCHEDULE_REQUESTS):
        y = top + r * (cell_h + 6)
        svg.text(20, y + 20, f"{name}: {prompt_len}-token prompt", size=14, bold=True)
        svg.text(20, y + 38, f"{max_tokens} tokens out, arrives at step {at}", size=12, fill=GREY)
        for step, row in enumerate(steps):
            if name not in row:
                continue
            state, n, samples = row[name]
            fill, stroke, _ = STATES[state]
            x = label_w + step * cell_w
            svg.group(f"cell-{name}-{step}", {"state": state, "tokens": n, "samples": int(samples)})
            svg.rect(x + 2, y, cell_w - 4, cell_h, fill, stroke)
            if n:
                svg.text(x + cell_w / 2, y + 29, str(n), size=17, anchor="middle", bold=True)
            if samples:
                svg.circle(x + cell_w - 11, y + 10, 4.5, INK)
            svg.end_group()
    y = top + len(SCHEDULE_REQUESTS) * (cell_h + 6) + 22
    svg.text(label_w - 10, y, f"tokens (budget {lim['max_num_batched_tokens']})", size=13, anchor="end")
    for step, total in enumerate(totals):
        svg.text(label_w + step * cell_w + cell_w / 2, y, str(total), size=14, anchor="middle", fill=GREY)
    y += 40
    svg.legend(20, y, [(fill, stroke, label) for fill, stroke, label in STATES.values()])
    preempted = [(name, step) for step, row in enumerate(steps) for name, cell in row.items() if cell[0] == "preempted"]
    svg.text(20, y + 30, "preempted: its blocks freed, it waits, and once readmitted computes its tokens again ("
             + ", ".join(f"{name} at step {step}" for name, step in preempted) + ")", size=13)
    y += 28
    svg.circle(26, y + 29, 4.5, INK)
    svg.text(42, y + 34, "the step computes the request's last token, so it samples the next one "
             "(a chunk that stops mid-prompt samples nothing)", size=13)
    return svg.render()


# ---- 3. the flattened batch (chapter 04, section 1) ----

def draw_flattened_batch() -> str:
    rec, info, null_slot = flattened_step()
    owners, n = info["owners"], len(rec["input_ids"])
    colors = {name: i for i, name in enumerate(dict.fromkeys(owners))}
    x0, cell_w, top = 190, 80, 118
    svg = Svg(470, "One step's tokens flattened into one row")
    svg.text(20, 28, f"One step, flattened: {len(owners)} tokens of {len(colors)} sequences in the {n}-token bucket",
             size=17, bold=True)
    svg.text(20, 50, "what ModelRunner.compute_logits hands its graph (chapter 04's example, the step that ends "
             "c's prompt)", size=13, fill=GREY)
    for name, i in colors.items():  # a header over each sequence's run of tokens
        cols = [c for c, owner in enumerate(owners) if owner == name]
        x = x0 + cols[0] * cell_w
        svg.rect(x + 2, 66, len(cols) * cell_w - 4, 26, FILLS[i], STROKES[i])
        svg.text(x + len(cols) * cell_w / 2, 84, f"{name}: {info['kinds'][name]}", size=14, anchor="middle", bold=True)
    if n > len(owners):
        x = x0 + len(owners) * cell_w
        svg.rect(x + 2, 66, (n - len(owners)) * cell_w - 4, 26, LIGHT, "#999999", dash=True)
        svg.text(x + (n - len(owners)) * cell_w / 2, 84, "padding to the bucket", size=14, anchor="middle")

    def table(row: np.ndarray) -> str:
        blocks = [int(b) for b in row if b != info["null_block"]]
        return " ".join(map(str, blocks)) if blocks else "null"

    rows = [("input_ids", "(1, N)", [str(int(v)) for v in rec["input_ids"]]),
            ("positions", "(1, N)", [str(int(v)) for v in rec["positions"]]),
            ("slot_mapping", "(N,)", [str(int(v)) for v in rec["slot_mapping"]]),
            ("block_tables", f"(N, {rec['block_tables'].shape[1]})", [table(r) for r in rec["block_tables"]])]
    for r, (label, shape, values) in enumerate(rows):
        y = top + r * 44
        svg.text(20, y + 23, label, size=15, mono=True)
        svg.text(x0 - 10, y + 23, shape, size=12, anchor="end", fill=GREY)
        svg.group(f"row-{label}", {"values": " ".join(values)})
        for c, value in enumerate(values):
            pad = c >= len(owners)
            fill, stroke = (LIGHT, "#999999") if pad else (FILLS[colors[owners[c]]], STROKES[colors[owners[c]]])
            svg.rect(x0 + c * cell_w + 2, y, cell_w - 4, 36, fill, stroke, dash=pad)
            svg.text(x0 + c * cell_w + cell_w / 2, y + 24, value, size=15, anchor="middle", mono=True)
        svg.end_group()

    # logits_indices: the rows that reach lm_head, padded to a bucket of rows
    y = top + len(rows) * 44 + 58
    svg.text(20, y + 23, "logits_indices", size=15, mono=True)
    svg.text(x0 - 10, y + 23, f"({len(rec['logits_indices'])},)", size=12, anchor="end", fill=GREY)
    sampled = len(dict.fromkeys(owners[int(i)] for i in rec["logits_indices"][:len(colors)]))
    svg.group("row-logits_indices", {"values": " ".join(str(int(v)) for v in rec["logits_indices"])})
    for k, index in enumerate(rec["logits_indices"]):
        pad = k >= sampled
        x = x0 + k * cell_w
        svg.rect(x + 2, y, cell_w - 4, 36, "#ffffff", "#999999" if pad else INK, dash=pad)
        svg.text(x + cell_w / 2, y + 24, str(int(index)), size=15, anchor="middle", mono=True)
        target = x0 + int(index) * cell_w + cell_w / 2
        svg.line(x + cell_w / 2, y, target, top + len(rows) * 44 - 6, stroke="#999999" if pad else INK, arrow=True,
                 dash=pad)
    svg.end_group()
    svg.text(x0 + len(rec["logits_indices"]) * cell_w + 8, y + 16, "the token of each sequence that samples,", size=13)
    svg.text(x0 + len(rec["logits_indices"]) * cell_w + 8, y + 33, "padded to a bucket of rows", size=13)
    y += 70
    svg.text(20, y, f"slot = block_table[pos // 4] * 4 + pos % 4;  padding: token 0, position 0, null slot {null_slot}",
             size=13, mono=True, fill=GREY)
    svg.legend(20, y + 30, [(FILLS[i], STROKES[i], f"sequence {name}") for name, i in colors.items()]
               + [(LIGHT, "#999999", "padding (reads and writes only the null block)")])
    return svg.render()


# ---- 4. the online softmax (chapter 05, section 3) ----

def draw_online_softmax() -> str:
    tiles = online_softmax(SCORES, VALUES, TILE)
    weights = np.exp(SCORES - SCORES.max())
    plain = float(weights / weights.sum() @ VALUES)
    online = tiles[-1]["acc"] / tiles[-1]["l"]
    assert abs(online - plain) < 1e-12, f"online softmax {online} != plain {plain}"

    svg = Svg(560, "The online softmax: keys in tiles, the running max and sum rescaled")
    svg.text(20, 28, "Online softmax: one pass over the keys, tile by tile", size=17, bold=True)
    svg.text(20, 50, f"{len(SCORES)} scores s = q . k in tiles of {TILE} keys (the kernels use 32); "
             "m = running max, l = running sum of exp(s - m)", size=13, fill=GREY)
    x0, key_w, zero_y, unit = 250, 50, 200, 38  # bars: 38 px per unit of score
    tile_w = TILE * key_w
    svg.line(x0 - 6, zero_y, x0 + len(SCORES) * key_w + 6, zero_y, stroke=GREY, width=1)
    svg.text(x0 - 12, zero_y + 5, "s = 0", size=12, anchor="end", fill=GREY)
    for t, row in enumerate(tiles):
        tx = x0 + t * tile_w
        svg.rect(tx + 2, 66, tile_w - 4, 224, FILLS[t], STROKES[t], dash=True)
        svg.text(tx + 10, 84, f"tile {t}", size=14, bold=True)
        my = zero_y - row["m"] * unit  # the running max after this tile
        svg.line(tx + 4, my, tx + tile_w - 4, my, stroke=HIGHLIGHT, width=2.5)
        svg.text(tx + tile_w - 8, my - 5, f"m = {row['m']:.1f}", size=13, anchor="end", fill=HIGHLIGHT, bold=True)
    svg.group("scores", {"values": " ".join(f"{s:.1f}" for s in SCORES)})
    for k, s in enumerate(SCORES):
        x = x0 + k * key_w + 13
        svg.rect(x, zero_y - max(s, 0) * unit, key_w - 26, abs(s) * unit, "#555555", "#333333")
        svg.text(x0 + k * key_w + key_w / 2, 258, f"{s:.1f}", size=12, anchor="middle", mono=True)
    svg.end_group()
    svg.text(x0 - 12, 258, "s", size=13, anchor="end", mono=True)
    svg.text(x0 - 12, 280, "v", size=13, anchor="end", mono=True)
    for k, v in enumerate(VALUES):
        svg.text(x0 + k * key_w + key_w / 2, 280, f"{v:.1f}", size=12, anchor="middle", mono=True, fill=GREY)
    svg.text(20, 170, "the red line:", size=13, fill=HIGHLIGHT)
    svg.text(20, 186, "m after each tile", size=13, fill=HIGHLIGHT)

    # the update, tile by tile
    labels = [("m_old -> m_new", lambda r: f"{r['m_old']:.1f} -> {r['m']:.1f}"),
              ("a = exp(m_old - m_new)", lambda r: f"{r['a']:.4f}"),
              ("sum p, p = exp(s - m_new)", lambda r: f"{r['p_sum']:.4f}"),
              ("a * l_old", lambda r: f"{r['a']:.4f} * {r['l_old']:.4f}"),
              ("l = a * l_old + sum p", lambda r: f"{r['l']:.4f}"),
              ("acc = a * acc_old + p . v", lambda r: f"{r['acc']:.4f}")]
    y = 320
    svg.group("updates", {"m": " ".join(f"{r['m']:.1f}" for r in tiles), "l": " ".join(f"{r['l']:.4f}" for r in tiles)})
    for label, cell in labels:
        svg.text(20, y, label, size=13, mono=True)
        for t, row in enumerate(tiles):
            svg.text(x0 + t * tile_w + tile_w / 2, y, cell(row), size=13, anchor="middle", mono=True)
        y += 26
    svg.end_group()
    svg.text(20, y + 10, "tile 0 starts from m = -inf, l = 0, so a = 0. Tile 1 raises the max: what was summed is "
             "rescaled by a < 1.", size=13)
    svg.text(20, y + 30, "Tile 2 keeps the max: a = 1. Each key is read once.", size=13)
    svg.text(20, y + 64, f"out = acc / l = {online:.6f}    plain softmax(s) . v = {plain:.6f}    (equal)",
             size=15, mono=True, bold=True)
    return svg.render()


# ---- 5. the tensor-parallel split (chapter 08, section 1) ----

def draw_tp_split(size: int = 3) -> str:
    config, tp, qkv_device, gate_up_device = tp_layout(size)
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    scale = 0.1  # px per feature
    svg = Svg(616, f"Tensor parallel over {size} devices: column-parallel then row-parallel")
    svg.text(20, 28, f"Tensor parallel, tp = {size}: split by output rows, then by input columns", size=17, bold=True)
    svg.text(20, 50, f"SmolLM2-135M: hidden {d}, {config.num_attention_heads} heads and {config.num_key_value_heads} "
             f"KV heads of {hd}, intermediate {f}; weights drawn as (out, in), {scale} px per feature",
             size=13, fill=GREY)

    def weight(ident: str, x: float, y: float, owners: np.ndarray, in_f: int, by: str, name: str) -> None:
        """A weight (len(owners) rows if by rows, else (d, len(owners)) columns) with each device's part colored."""
        out_f = len(owners) if by == "rows" else d
        in_f = in_f if by == "rows" else len(owners)
        counts = " ".join(str(int((owners == i).sum())) for i in range(size))
        svg.group(ident, {f"{by}-per-device": counts})
        start = 0
        for k in range(1, len(owners) + 1):
            if k == len(owners) or owners[k] != owners[start]:
                i, run = int(owners[start]), (k - start) * scale
                if by == "rows":
                    svg.rect(x, y + start * scale, in_f * scale, run, FILLS[i], STROKES[i], width=0.8)
                else:
                    svg.rect(x + start * scale, y, run, out_f * scale, FILLS[i], STROKES[i], width=0.8)
                start = k
        svg.end_group()
        svg.rect(x, y, in_f * scale, out_f * scale, "none", INK, width=1.5)
        svg.text(x + in_f * scale / 2, y - 8, name, size=14, anchor="middle", bold=True, mono=True)

    def note(x: float, y: float, lines: list[str]) -> None:
        for k, line in enumerate(lines):
            svg.text(x, y + k * 16, line, size=12, bold=k == 0, fill=INK if k == 0 else GREY)

    def per_device(x: float, y: float, title: str, lines: list[str]) -> None:
        svg.text(x + 80, y - 8, title, size=14, anchor="middle", bold=True)
        for i, text in enumerate(lines):
            svg.rect(x, y + i * 34, 160, 30, FILLS[i], STROKES[i])
            svg.text(x + 80, y + i * 34 + 20, text, size=13, anchor="middle")

    def all_reduce(x: float, y: float) -> None:
        svg.rect(x, y, 148, 52, "#fff3cd", "#b8860b", 2)
        svg.text(x + 74, y + 22, "ALL-REDUCE", size=14, anchor="middle", bold=True)
        svg.text(x + 74, y + 41, f"sums the {size} partial (T, {d})", size=12, anchor="middle")

    # attention: x -> qkv_proj (column) -> attention per device -> o_proj (row) -> all-reduce
    y = 96
    svg.rect(20, y + 33, 96, 30, "#ffffff", INK)
    svg.text(68, y + 53, f"x (T, {d})", size=13, anchor="middle", mono=True)
    svg.text(68, y + 82, "whole on", size=12, anchor="middle", fill=GREY)
    svg.text(68, y + 97, "every device", size=12, anchor="middle", fill=GREY)
    svg.line(118, y + 48, 154, y + 48, arrow=True)
    weight("qkv_proj", 160, y, qkv_device, d, "rows", "qkv_proj")
    for part, first, rows in (("q", 0, q_rows), ("k", q_rows, kv_rows), ("v", q_rows + kv_rows, kv_rows)):
        svg.text(160 + d * scale + 6, y + (first + rows / 2) * scale + 5, part, size=13, mono=True)
    note(160, y + (q_rows + 2 * kv_rows) * scale + 20,
         ["column-parallel: split by output rows",
          f"each device {(q_rows + 2 * kv_rows) // size} rows: {tp.heads} q heads, {tp.kv_heads} k and "
          + f"{tp.kv_heads} v head of {hd}", f"({q_rows + 2 * kv_rows} x {d} on one device)"])
    svg.line(240, y + 48, 314, y + 48, arrow=True)
    kv_of = [sorted({int(r) // hd for r in np.flatnonzero(qkv_device[q_rows:q_rows + kv_rows] == i)})
             for i in range(size)]
    per_device(320, y + 0, "attention, per device",
               [f"heads {i * tp.heads}-{(i + 1) * tp.heads - 1}, KV head {','.join(map(str, kv_of[i]))}"
                for i in range(size)])
    svg.line(482, y + 48, 512, y + 48, arrow=True)
    o_cols = tp.heads * hd
    weight("o_proj", 518, y + 19, np.repeat(np.arange(size), o_cols), q_rows, "columns", "o_proj")
    note(490, y + 19 + d * scale + 20, ["row-parallel: split by input columns",
                                        f"{d} x {o_cols} each: a partial (T, {d})"])
    svg.line(518 + q_rows * scale + 2, y + 48, 698, y + 48, arrow=True)
    all_reduce(704, y + 22)

    # the MLP: x' -> gate, up (column) -> silu(gate) * up -> down_proj (row) -> all-reduce
    y = 330
    svg.line(778, 96 + 74, 778, y - 46, dash=True)
    svg.line(778, y - 46, 68, y - 46, dash=True)
    svg.line(68, y - 46, 68, y + 62, arrow=True, dash=True)
    svg.rect(20, y + 64, 96, 30, "#ffffff", INK)
    svg.text(68, y + 84, f"x' (T, {d})", size=13, anchor="middle", mono=True)
    svg.line(118, y + 79, 154, y + 79, arrow=True)
    weight("gate", 160, y, gate_up_device[:f], d, "rows", "gate")
    weight("up", 236, y, gate_up_device[f:], d, "rows", "up")
    note(160, y + f * scale + 20, ["column-parallel: gate_up_proj by rows",
                                   f"each device {f // size} rows of gate and {f // size} of up",
                                   f"({2 * f} x {d} on one device)"])
    svg.line(298, y + 79, 314, y + 79, arrow=True)
    per_device(320, y + 30, "per device", [f"silu(g) * u: (T, {f // size})" for _ in range(size)])
    svg.line(482, y + 79, 512, y + 79, arrow=True)
    weight("down_proj", 518, y + 50, np.repeat(np.arange(size), f // size), f, "columns", "down_proj")
    note(518, y + 50 + d * scale + 20, ["row-parallel: split by input columns",
                                        f"{d} x {f // size} each: a partial (T, {d})"])
    svg.line(518 + f * scale + 2, y + 79, 698, y + 79, arrow=True)
    all_reduce(704, y + 53)

    svg.legend(20, 600, [(FILLS[i], STROKES[i], f"device {i}") for i in range(size)]
               + [("#fff3cd", "#b8860b", "the only communication: two all-reduces per layer")])
    return svg.render()


FIGURES = {
    "block-table": draw_block_table,
    "schedule": draw_schedule,
    "flattened-batch": draw_flattened_batch,
    "online-softmax": draw_online_softmax,
    "tp-split": draw_tp_split,
}


def write_figures(out_dir: Path = IMAGES, names: list[str] | None = None) -> list[Path]:
    """Draw the figures (all, or `names`) into `out_dir` as NAME.svg; returns the paths written."""
    paths = []
    for name in names or list(FIGURES):
        path = out_dir / f"{name}.svg"
        path.write_text(FIGURES[name](), encoding="utf-8", newline="\n")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"the figures to draw, of {', '.join(FIGURES)} (default: all)")
    parser.add_argument("--out", type=Path, default=IMAGES, help="the folder to write into (default: docs/images)")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in FIGURES]
    if unknown:
        parser.error(f"no figure named {', '.join(unknown)}; the figures: {', '.join(FIGURES)}")
    for path in write_figures(args.out, args.names):
        print(path)


if __name__ == "__main__":
    main()
