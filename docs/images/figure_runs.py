"""What each of the chapters' figures shows, run through the engine's own code: the block tables a BlockManager
hands out, the Scheduler's steps, the inputs ModelRunner.compute_logits gives its graph, the online softmax's
update, TensorParallel's rows (docs/images/draw_figures.py draws them)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tinygrad import Tensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's tinyvllm, when run as a script

from tinyvllm.core.block_manager import BlockManager  # noqa: E402
from tinyvllm.core.outputs import ModelRunnerOutput  # noqa: E402
from tinyvllm.core.scheduler import Scheduler  # noqa: E402
from tinyvllm.core.sequence import Sequence  # noqa: E402
from tinyvllm.model.config import ModelConfig  # noqa: E402
from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.weights import default_model_path  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402
from tinyvllm.worker.model_runner import ModelRunner  # noqa: E402


def block_table_run() -> tuple[BlockManager, dict[str, Sequence]]:
    """Chapter 02's steps: a 4-token and a 7-token prompt, prefill, then decode steps (A's takes a second block)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    seqs = {"A": Sequence(0, [11, 12, 13, 14]), "B": Sequence(1, [21, 22, 23, 24, 25, 26, 27])}
    for seq in seqs.values():
        bm.allocate(seq)
    for seq, first in ((seqs["A"], 17), (seqs["B"], 28)):  # prefill computed each prompt and sampled a token
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token_id(first)
    for seq, token in ((seqs["A"], 18), (seqs["B"], 29), (seqs["A"], 19)):  # three decode steps
        bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        seq.append_token_id(token)
    return bm, seqs


SCHEDULE_REQUESTS = [  # name, prompt tokens, max_tokens, the step it arrives at
    ("A", 6, 5, 0), ("B", 9, 4, 0), ("C", 13, 3, 1), ("D", 4, 4, 3)]


SCHEDULE_LIMITS = {"num_blocks": 9, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4}


def schedule_trace() -> tuple[list[dict[str, tuple[str, int, bool]]], list[int]]:
    """Run the real Scheduler on SCHEDULE_REQUESTS with made-up tokens. Per step: name -> (state, tokens computed,
    whether it sampled), for each request that has arrived; and the tokens each step computed."""
    lim = SCHEDULE_LIMITS
    scheduler = Scheduler(lim["num_blocks"], lim["block_size"], max_model_len=lim["num_blocks"] * lim["block_size"],
                          max_num_seqs=lim["max_num_seqs"], max_num_batched_tokens=lim["max_num_batched_tokens"])
    seqs: dict[str, Sequence] = {}
    steps, totals = [], []
    while len(seqs) < len(SCHEDULE_REQUESTS) or scheduler.has_unfinished_seqs():
        for name, prompt_len, max_tokens, at in SCHEDULE_REQUESTS:
            if at == len(steps):
                seqs[name] = Sequence(name, list(range(100, 100 + prompt_len)),
                                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                scheduler.add_seq(seqs[name])
        out = scheduler.schedule()
        row = {}
        for name, seq in seqs.items():
            if name in out.num_scheduled_tokens:
                n = out.num_scheduled_tokens[name]
                decode = n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1
                row[name] = ("decode" if decode else "prefill", n, out.samples(seq))
            elif seq in out.preempted_seqs:
                row[name] = ("preempted", 0, False)
            else:
                row[name] = ("finished" if seq.is_finished else "waiting", 0, False)
        scheduler.update_from_output(out, ModelRunnerOutput({s.seq_id: [7] for s in out.scheduled_seqs}))
        steps.append(row)
        totals.append(out.total_num_scheduled_tokens)
    return steps, totals


def flattened_step() -> tuple[dict[str, np.ndarray], dict, int]:
    """Chapter 04's example, through ModelRunner.compute_logits with its graph replaced by a recorder: the inputs of
    the step that finishes c's prompt (5 tokens in the 8-token bucket). Returns them, the names of the scheduled
    sequences by row, and the null slot."""
    block_size, num_blocks = 4, 16
    scheduler = Scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=32, max_num_seqs=4,
                          max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a, b = Sequence("a", [11, 12, 13, 14, 15], params), Sequence("b", [21, 22, 23], params)
    for seq in (a, b):
        scheduler.add_seq(seq)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput({"a": [16], "b": [24]}))
    scheduler.add_seq(Sequence("c", [31, 32, 33, 34, 35, 36, 37, 38, 39], params))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput({"a": [17], "b": [25]}))
    out = scheduler.schedule()

    recorded: dict[str, np.ndarray] = {}

    def recording_forward(input_ids, positions, slot_mapping, block_tables, logits_indices, num_blocks):
        recorded.update(input_ids=input_ids.numpy()[0], positions=positions.numpy()[0],
                        slot_mapping=slot_mapping.numpy(), block_tables=block_tables.numpy(),
                        logits_indices=logits_indices.numpy())
        return Tensor(np.zeros((len(recorded["logits_indices"]), 10), dtype=np.float32))

    kv_cache = SimpleNamespace(block_size=block_size, null_block=num_blocks, null_slot=num_blocks * block_size)
    model = SimpleNamespace(device="CPU", devices="CPU", config=SimpleNamespace(vocab_size=10))
    runner = ModelRunner(model, kv_cache, max_model_len=32, max_num_batched_tokens=8, max_num_seqs=4)
    runner._jits = {(n, rows): recording_forward for n in runner.token_buckets for rows in runner.token_buckets}
    runner.compute_logits(out)
    owners = [seq.seq_id for seq in out.scheduled_seqs for _ in range(out.num_scheduled_tokens[seq.seq_id])]
    kinds = {seq.seq_id: "decode" if out.num_scheduled_tokens[seq.seq_id] == 1 else "prompt chunk"
             for seq in out.scheduled_seqs}
    return recorded, {"owners": owners, "kinds": kinds, "null_block": num_blocks}, kv_cache.null_slot


SCORES = np.array([0.5, 1.2, -0.3, 0.8, 2.1, 0.4, 2.6, -1.0, 1.5, 2.2, 0.9, 1.8])  # q . k of 12 keys


VALUES = np.array([0.9, -0.4, 0.3, 1.1, -0.7, 0.2, 0.6, -1.2, 0.5, -0.1, 0.8, 0.4])  # one value dimension


TILE = 4


def online_softmax(scores: np.ndarray, values: np.ndarray, tile: int) -> list[dict[str, float]]:
    """The kernels' update, one tile at a time: the running max m, the sum l and the weighted sum acc after each
    tile, with the tile's rescale factor a = exp(m_old - m_new)."""
    m, l_sum, acc, rows = -np.inf, 0.0, 0.0, []
    for t0 in range(0, len(scores), tile):
        s, v = scores[t0:t0 + tile], values[t0:t0 + tile]
        m_new = max(m, float(s.max()))
        a, p = float(np.exp(m - m_new)), np.exp(s - m_new)
        rows.append({"m_old": m, "m": m_new, "a": a, "p_sum": float(p.sum()), "l_old": l_sum, "acc_old": acc})
        m, l_sum, acc = m_new, a * l_sum + float(p.sum()), a * acc + float(p @ v)
        rows[-1].update(l=l_sum, acc=acc)
    return rows


def tp_layout(size: int = 3) -> tuple[ModelConfig, object, np.ndarray, np.ndarray]:
    """SmolLM2's config from the default GGUF, its TensorParallel split over `size` devices, and which device holds
    each row of the fused qkv_proj and gate_up_proj (TensorParallel.fused_rows: device by device)."""
    from tinyvllm.distributed.tensor_parallel import TensorParallel  # Phase 8

    config = ModelConfig.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tp = TensorParallel(config, size, "CPU")
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def device_of_rows(sizes: list[int], parts: list[str]) -> np.ndarray:
        order = tp.fused_rows(sizes, parts).reshape(size, -1)  # row ids, device by device
        device = np.empty(sum(sizes), dtype=int)
        for i in range(size):
            device[order[i]] = i
        return device

    return (config, tp, device_of_rows([q_rows, kv_rows, kv_rows], ["q", "k", "v"]),
            device_of_rows([config.intermediate_size] * 2, ["gate", "up"]))
