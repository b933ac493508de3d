"""Phase 3: the engine on the paged cache (Phase 2) gives the contiguous cache's logits and tokens (Phase 1), on the
real model."""

from __future__ import annotations

import numpy as np
import pytest

from fake_engine import run_offline
from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
from tinyvllm import ops
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.plugins import provided
from tinyvllm.sampling_params import SamplingParams


# ---- the real model: the paged engine and the contiguous cache give the same logits and tokens ----

@pytest.fixture(scope="module")
def model_and_contiguous(generator):
    return generator.engine, ContiguousModelRunner(generator.model, 256)


def contiguous_greedy(runner: ContiguousModelRunner, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """Phase 1's loop: the prompt's last logits as log-probabilities, and n greedy tokens."""
    logits = runner.prefill(prompt)
    first, tokens = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max(), [int(logits.argmax())]
    for i in range(n - 1):
        tokens.append(int(runner.decode(tokens[-1], len(prompt) + i).argmax()))
    return first, tokens


# the smallest block (every token its own block) and the default one; the prompt lengths below put a prompt's end
# on either side of a block's edge for each (tests/attention/test_kernels_paged_attention.py sweeps more block sizes)
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_tokens_equal_contiguous(model_and_contiguous, block_size):
    loaded, contiguous = model_and_contiguous
    # Phase 2's portable path: bit-near the contiguous cache (the kernels of Phase 5 agree to ~3e-5 in logits,
    # float32 summation order; tests/attention/test_kernels_paged_attention.py checks them against this path). A
    # budget of 4 tokens a step keeps the graphs to three (1, 2, 4 tokens) and chunks every prompt.
    # before Phase 5 the matmuls are tinygrad's portable ones, whose float32 summation order follows the shape of
    # the batch (a 4-token step here, a 32-token chunk there); the matmul kernel's rows do not depend on it
    tolerance = 1e-5 if provided("linear", ops.linear) is not ops.linear else 1e-4
    engine = LLMEngine(loaded.model, tokenizer=loaded.tokenizer, max_model_len=256, block_size=block_size,
                       num_gpu_blocks_override=256 // block_size + 2, max_num_seqs=1, max_num_batched_tokens=4,
                       portable_attention=True)
    base = [504, 3575, 282, 4649, 314, 253, 3469, 338, 1296, 5145, 28, 672, 314, 3575, 282, 4649, 30, 198] * 6
    for n in sorted({1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2} - {0}):
        prompt = base[:n]
        ref_logprobs, ref_tokens = contiguous_greedy(contiguous, prompt, 6)
        out = run_offline(engine, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5))
        _, top = out.outputs[0].logprobs[0]
        assert max(abs(lp - ref_logprobs[token]) for token, lp in top) < tolerance
        assert out.outputs[0].token_ids == ref_tokens, f"prompt of {n} tokens, block_size {block_size}"
    block_manager = engine.scheduler.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks


def test_a_context_the_cache_cannot_hold_is_reported(model_and_contiguous):
    loaded, _ = model_and_contiguous
    with pytest.raises(ValueError, match="fit in the KV cache"):
        LLMEngine(loaded.model, tokenizer=loaded.tokenizer, max_model_len=256, block_size=4, num_gpu_blocks_override=2)
