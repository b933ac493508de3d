"""The chapters' figures (docs/images/*.svg) are what docs/images/draw_figures.py draws from the engine's code now.

Each figure is drawn again into a temporary folder and must equal the committed file byte for byte: a change to the
code a figure shows (the block manager, the scheduler, the runner's flattening, the tensor-parallel split) that
changes the picture fails here until the figures are redrawn. Each file parses as SVG, and the numbers a figure
carries in its `data-*` attributes are checked against the same code, run here on its own.
"""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.sequence import Sequence
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.gguf import GGUFFile
from tinyvllm.model.weights import default_model_path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
_spec = importlib.util.spec_from_file_location("draw_figures", IMAGES / "draw_figures.py")
draw_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(draw_figures)

SVG = "{http://www.w3.org/2000/svg}"
# the tensor-parallel split is drawn by Phase 8's TensorParallel; the others need Phases 1-3
NAMES = [pytest.param(name, marks=pytest.mark.phase8) if name == "tp-split" else name for name in draw_figures.FIGURES]


def data(name: str, ident: str) -> dict[str, str]:
    """The `data-*` attributes of the element `ident` of docs/images/NAME.svg."""
    root = ET.parse(IMAGES / f"{name}.svg").getroot()
    (element,) = [e for e in root.iter() if e.get("id") == ident]
    return {key.removeprefix("data-"): value for key, value in element.attrib.items() if key.startswith("data-")}


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_figure_is_what_the_script_draws(name: str, tmp_path: Path):
    (drawn,) = draw_figures.write_figures(tmp_path, [name])
    committed = IMAGES / f"{name}.svg"
    assert committed.is_file() and drawn.read_bytes() == committed.read_bytes(), (
        f"docs/images/{name}.svg is not what the code draws now: run docs/images/draw_figures.py and commit the figure")


@pytest.mark.parametrize("name", list(draw_figures.FIGURES))
def test_each_figure_is_well_formed_svg_of_a_page_width(name: str):
    root = ET.parse(IMAGES / f"{name}.svg").getroot()
    assert root.tag == f"{SVG}svg"
    assert 700 <= float(root.get("width")) <= 900 and root.find(f"{SVG}title") is not None
    sizes = [float(e.get("font-size")) for e in root.iter(f"{SVG}text")]
    assert min(sizes) >= 11, f"{name}.svg has text of {min(sizes)} px: too small to read"


def test_the_block_tables_drawn_are_the_block_managers():
    """Chapter 02's steps, run here: the tables and the slots written are the ones the figure shows."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Sequence(0, [11, 12, 13, 14]), Sequence(1, [21, 22, 23, 24, 25, 26, 27])
    bm.allocate(a)
    bm.allocate(b)
    for seq, first in ((a, 17), (b, 28)):
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token_id(first)
    for seq, token in ((a, 18), (b, 29), (a, 19)):
        bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        seq.append_token_id(token)

    assert data("block-table", "table-A")["entries"].split() == [str(block) for block in a.block_table] == ["0", "3"]
    assert data("block-table", "table-B")["entries"].split() == [str(block) for block in b.block_table]
    written = {f"{slot}:{name}{pos}" for name, seq in (("a", a), ("b", b))
               for pos, slot in enumerate(bm.get_slot_mapping(seq, 0, seq.num_computed_tokens))}
    pool = data("block-table", "pool")
    assert set(pool["written"].split()) == written and "13:a5" in written
    assert pool["free"].split() == [str(block.block_id) for block in bm.free_block_queue]


def test_the_schedule_drawn_is_the_schedulers():
    steps, totals = draw_figures.schedule_trace()
    budget = draw_figures.SCHEDULE_LIMITS["max_num_batched_tokens"]
    states = set()
    for step, row in enumerate(steps):
        for name, (state, tokens, samples) in row.items():
            assert data("schedule", f"cell-{name}-{step}") == {"state": state, "tokens": str(tokens),
                                                               "samples": str(int(samples))}
            states.add(state)
        assert sum(tokens for _, tokens, _ in row.values()) == totals[step] <= budget
    assert states == set(draw_figures.STATES), "the example should show every state"
    prompts = {name: prompt_len for name, prompt_len, _, _ in draw_figures.SCHEDULE_REQUESTS}
    assert any(state == "prefill" and not samples and tokens < prompts[name]  # a chunk that stops mid-prompt
               for row in steps for name, (state, tokens, samples) in row.items())


def test_the_flattened_batch_drawn_is_what_the_runner_hands_its_graph():
    recorded, info, null_slot = draw_figures.flattened_step()
    for row in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        assert data("flattened-batch", f"row-{row}")["values"].split() == [str(int(v)) for v in recorded[row]]
    block_size = 4
    for i in range(len(recorded["input_ids"])):  # Phase 2's formula, through each token's own block table row
        table, pos = recorded["block_tables"][i], recorded["positions"][i]
        expected = null_slot if i >= len(info["owners"]) else table[pos // block_size] * block_size + pos % block_size
        assert recorded["slot_mapping"][i] == expected


def test_the_online_softmax_drawn_is_the_plain_softmax():
    scores, tile = draw_figures.SCORES, draw_figures.TILE
    updates = data("online-softmax", "updates")
    tile_maxima = [scores[:end].max() for end in range(tile, len(scores) + 1, tile)]
    assert updates["m"].split() == [f"{m:.1f}" for m in tile_maxima]
    assert updates["l"].split()[-1] == f"{np.exp(scores - scores.max()).sum():.4f}"


def test_the_tensor_parallel_split_drawn_is_smollm2s_over_three_devices():
    config = ModelConfig.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    size, hd = 3, config.head_dim
    q, kv = config.num_attention_heads // size, max(1, config.num_key_value_heads // size)
    assert data("tp-split", "qkv_proj")["rows-per-device"].split() == [str((q + 2 * kv) * hd)] * size
    assert data("tp-split", "gate")["rows-per-device"].split() == [str(config.intermediate_size // size)] * size
    assert data("tp-split", "o_proj")["columns-per-device"].split() == [str(q * hd)] * size
    assert data("tp-split", "down_proj")["columns-per-device"].split() == [str(config.intermediate_size // size)] * size
