"""What the engine is doing right now, as plain data: the KV block pool, the queues, the last steps.

    {"config":   model, quantization, dtypes, device, block_size, num_blocks, limits of a step, policy,
     "kv_cache": {"ref_cnt": [r0, r1, ...], "cached": [0/1, ...], "num_free_blocks", ...}   one entry per block
     "running":  [{request_id, status, priority, num_computed_tokens, num_tokens, block_table, ...}, ...]
     "waiting":  [... the same, in the order they will be admitted ...]
     "steps":    [{time, step_ms, batch_size, num_prefill_tokens, num_decode_tokens, num_preempted}, ...]
     "encoder_cache": {cache_size, num_free_slots, entries: [{mm_hash, num_embeds, requests, freeable}], ...}}
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

from tinyvllm.core.sequence import Sequence
from tinyvllm.ggml_types import GGML_TYPES

NUM_STEP_RECORDS = 256  # steps kept: what the dashboard's step chart and its rates look back over


@dataclass
class StepRecord:
    """One engine step: what the scheduler gave it, and how long it took."""

    time: float  # time.monotonic() when the step ended
    step_ms: float
    batch_size: int  # sequences scheduled
    num_prefill_tokens: int  # prompt tokens computed (and tokens recomputed after a preemption)
    num_decode_tokens: int  # sequences computing only their last sampled token
    num_preempted: int
    num_sampled: int  # sequences that got a new token


class StepLog:
    """The last NUM_STEP_RECORDS steps."""

    def __init__(self, maxlen: int = NUM_STEP_RECORDS):
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self.num_steps = 0

    def begin(self, scheduler_output) -> tuple[float, int, int, int, int]:
        num_decode = sum(1 for seq in scheduler_output.scheduled_seqs if not seq.is_prefill)
        num_prefill = scheduler_output.total_num_scheduled_tokens - num_decode
        return (time.perf_counter(), len(scheduler_output.scheduled_seqs), num_prefill, num_decode,
                len(scheduler_output.preempted_seqs))

    def end(self, begun: tuple[float, int, int, int, int], num_sampled: int) -> None:
        start, batch_size, num_prefill, num_decode, num_preempted = begun
        self.records.append(StepRecord(time.monotonic(), (time.perf_counter() - start) * 1e3, batch_size,
                                       num_prefill, num_decode, num_preempted, num_sampled))
        self.num_steps += 1


def request_state(seq: Sequence, now: float) -> dict:
    return {"request_id": str(seq.seq_id), "status": seq.status.name, "priority": seq.priority,
            "num_computed_tokens": seq.num_computed_tokens, "num_tokens": seq.num_tokens,
            "num_prompt_tokens": seq.num_prompt_tokens, "num_output_tokens": seq.num_output_tokens,
            "num_cached_tokens": max(seq.num_cached_tokens, 0), "block_table": list(seq.block_table),
            "age_s": round(now - seq.arrival_time, 3)}


def weight_formats(model) -> str:
    """How the weights are stored: the engine's quantization method where it names one, else the formats found
    on the weights themselves (GGUF blocks carry a `ggml_type`): "Q4_1, embeddings Q8_0"; else the dtype."""
    method = getattr(model, "quantization", None)
    if method not in (None, "auto"):
        return str(method)

    def formats(weights) -> list[str]:
        found = []
        for weight in weights:
            for part in weight if isinstance(weight, tuple) else (weight,):  # a fusion on paper only: a tuple
                kind = getattr(part, "ggml_type", None)
                if kind is not None and GGML_TYPES.get(kind, str(kind)) not in found:
                    found.append(GGML_TYPES.get(kind, str(kind)))
        return found

    layers = getattr(model, "layers", None) or []
    linears = formats(vars(layers[0]).values() if layers else ())
    embeddings = formats([getattr(model, "embed_tokens", None)])
    if not linears and not embeddings:
        return f"none ({dtype_name(getattr(model, 'dtype', None))})"
    text = "+".join(linears) or dtype_name(getattr(model, "dtype", None))
    return text + (f", embeddings {'+'.join(embeddings)}" if embeddings and embeddings != linears else "")


def dtype_name(dtype) -> str:
    """tinygrad's dtype as numpy and torch name it: dtypes.float32 is "float32" (tinygrad says "float")."""
    name = getattr(dtype, "name", None)
    return {"float": "float32", "half": "float16", "double": "float64"}.get(name, name or str(dtype))


def engine_state(engine) -> dict:
    """The snapshot described at the top of this file, from an `LLMEngine`'s public attributes."""
    scheduler, model, now = engine.scheduler, engine.model, time.monotonic()
    bm, kv_cache, step_log = scheduler.block_manager, engine.kv_cache, engine.engine_core.step_log
    config = {
        "model": engine.model_name, "quantization": weight_formats(model),
        "dtype": dtype_name(getattr(model, "dtype", None)),
        "kv_cache_dtype": dtype_name(getattr(kv_cache, "dtype", None)),
        "device": str(getattr(model, "device", "")), "block_size": bm.block_size, "num_blocks": bm.num_blocks,
        "max_model_len": engine.max_model_len, "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens, "scheduling_policy": scheduler.policy,
        "enable_prefix_caching": bm.enable_prefix_caching}
    kv = {"ref_cnt": [block.ref_cnt for block in bm.blocks],
          "cached": [int(block.block_hash is not None) for block in bm.blocks],
          "num_free_blocks": bm.num_free_blocks, "num_cached_blocks": len(bm.cached_blocks)}
    return {"config": config, "kv_cache": kv, "encoder_cache": encoder_cache_state(engine),
            "running": [request_state(seq, now) for seq in scheduler.running],
            "waiting": [request_state(seq, now) for seq in scheduler.waiting],
            "steps": [{**asdict(record), "age_s": round(now - record.time, 3)} for record in step_log.records],
            "num_steps": step_log.num_steps}


def encoder_cache_state(engine) -> dict | None:
    """Phase 10's encoder cache: its room in embeddings, and each image's entry (None: a model without images)."""
    manager = engine.scheduler.encoder_cache_manager
    if manager is None:
        return None
    entries = [{"mm_hash": mm_hash[:16], "num_embeds": size, "requests": sorted(map(str, manager.cached[mm_hash])),
                "freeable": mm_hash in manager.freeable} for mm_hash, size in manager.sizes.items()]
    return {"cache_size": manager.cache_size, "num_free_slots": manager.num_free_slots, "entries": entries,
            "num_queries": manager.num_queries, "num_hits": manager.num_hits,
            "num_encoder_runs": engine.model_runner.encoder.num_encoder_runs}


def engine_stats(engine) -> dict:
    """An `LLMEngine`'s counters, as the server's /metrics reads them (LLMEngine.get_stats)."""
    scheduler = engine.scheduler
    bm, records = scheduler.block_manager, engine.engine_core.step_log.records
    last_step = records[-1] if records else None
    iteration_tokens = 0 if last_step is None else last_step.num_prefill_tokens + last_step.num_decode_tokens
    stats = {"num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
            "num_free_blocks": bm.num_free_blocks, "num_total_blocks": bm.num_blocks,
            "num_cached_blocks": len(bm.cached_blocks),  # free or not: blocks a new prompt may hit
            "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": scheduler.num_preemptions,
            # tokens the last step computed (vLLM's iteration_tokens_total); 0 before any step
            "iteration_tokens": iteration_tokens,
            "kv_cache_dtype": engine.kv_cache.dtype.name,  # Phase 7c: how K/V are stored, and what a token costs
            "kv_cache_bytes_per_token": engine.kv_cache.bytes_per_token,
            "block_size": bm.block_size, "max_model_len": engine.max_model_len,
            "enable_prefix_caching": engine.config.cache_config.enable_prefix_caching,
            "quantization": engine.model.quantization, "weight_bytes": engine.model.weight_formats()}
    if engine.model_runner.speculator is not None:
        stats.update(spec_decoding_stats(scheduler.spec_decoding_stats))
    return stats


def spec_decoding_stats(counts: dict) -> dict:
    """vLLM's spec_decode_* metrics from the scheduler's counters. mean accepted length: tokens a verify step gives
    a request (accepted + 1)."""
    drafts, accepted, steps = counts["num_draft_tokens"], counts["num_accepted_tokens"], counts["num_verify_steps"]
    return {"spec_decode_num_draft_tokens": drafts, "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_num_emitted_tokens": counts["num_emitted_tokens"], "spec_decode_num_verify_steps": steps,
            "spec_decode_acceptance_rate": accepted / drafts if drafts else 0.0,
            "spec_decode_mean_accepted_length": (accepted + steps) / steps if steps else 0.0}
