"""Phase 4's graders: the model runner's token buckets, and the device sampler's top-k and top-p filters
(course/phase4/). The filters run on tiny (S, V) logits in tinygrad; each row has its own parameter, as in a batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from tinygrad import Tensor

from tinyvllm.sample import device_sampler
from tinyvllm.worker import model_runner


def kept(logits: Tensor) -> list[list[int]]:
    """The token ids each row keeps (its logits above -inf)."""
    return [np.flatnonzero(row > -math.inf).tolist() for row in logits.numpy()]


def log_probs(*rows: list[float]) -> Tensor:
    return Tensor(np.log(np.array(rows, dtype=np.float32)))


# ---- buckets_up_to ----

@pytest.mark.task("buckets_up_to")
def test_buckets_are_powers_of_two_then_the_limit():
    got = model_runner.buckets_up_to(512)
    assert got == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], f"buckets_up_to(512): got {got}"
    got = model_runner.buckets_up_to(48)
    assert got == [1, 2, 4, 8, 16, 32, 48], f"buckets_up_to(48): the powers of two below 48, then 48; got {got}"


@pytest.mark.task("buckets_up_to")
def test_buckets_of_a_small_limit():
    assert model_runner.buckets_up_to(1) == [1], f"buckets_up_to(1): got {model_runner.buckets_up_to(1)}"
    assert model_runner.buckets_up_to(2) == [1, 2], f"buckets_up_to(2): got {model_runner.buckets_up_to(2)}"


@pytest.mark.task("buckets_up_to")
def test_a_step_is_padded_to_the_next_bucket():
    runner = SimpleNamespace(token_buckets=model_runner.buckets_up_to(48))  # what ModelRunner.__init__ keeps
    padded = [model_runner.ModelRunner.bucket_for(runner, n) for n in (1, 3, 17, 33, 48)]
    assert padded == [1, 4, 32, 48, 48], (
        f"steps of 1, 3, 17, 33 and 48 tokens with max_num_batched_tokens 48 run the graphs of {padded}")


# ---- apply_top_k ----  (every filter test: 2 rows of 5 logits, one graph shape compiled once)

@pytest.mark.task("apply_top_k")
def test_top_k_keeps_the_k_largest_of_each_row():
    logits = Tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.5, -1.0, 2.5, 0.0, -3.0]])
    out = device_sampler.apply_top_k(logits, Tensor([2, 3]))
    got = kept(out)
    assert got == [[1, 3], [0, 2, 3]], (f"top_k 2 over [1, 5, 3, 4, 2] keeps tokens 1 and 3; top_k 3 over "
                                        f"[0.5, -1, 2.5, 0, -3] keeps 0, 2 and 3; kept {got}")
    row = out.numpy()[0]
    assert row[1] == 5.0 and row[3] == 4.0, f"a kept token keeps its logit: got {row.tolist()}"


@pytest.mark.task("apply_top_k")
def test_top_k_at_or_over_the_candidates_is_off_and_ties_stay():
    logits = Tensor([[1.0, 2.0, -math.inf, 0.0, -math.inf], [2.0, 1.0, 2.0, 0.0, 2.0]])
    got = kept(device_sampler.apply_top_k(logits, Tensor([3, 2])))
    assert got[0] == [0, 1, 3], f"top_k 3 over a row of 3 finite logits filters nothing; kept {got[0]}"
    assert got[1] == [0, 2, 4], f"top_k 2 over [2, 1, 2, 0, 2]: the 2nd largest is 2, every 2 stays; kept {got[1]}"


# ---- apply_top_p ----

@pytest.mark.task("apply_top_p")
def test_top_p_keeps_the_nucleus_of_each_row():
    logits = log_probs([0.5, 0.3, 0.2, 1e-9, 1e-9], [0.1, 0.6, 0.3, 1e-9, 1e-9])
    got = kept(device_sampler.apply_top_p(logits, Tensor([0.6, 0.5])))
    assert got[0] == [0, 1], (f"top_p 0.6 over probabilities [0.5, 0.3, 0.2, ~0, ~0] should keep tokens 0 and 1 (0.5 "
                              f"is short of 0.6, 0.5 + 0.3 reaches it), kept {got[0]}")
    assert got[1] == [1], f"top_p 0.5 over [0.1, 0.6, 0.3, ~0, ~0] keeps token 1 alone (unsorted rows), kept {got[1]}"


@pytest.mark.task("apply_top_p")
def test_top_p_ties_one_and_the_top_token():
    logits = log_probs([0.25, 0.25, 0.4, 0.1, 1e-9], [0.9, 0.04, 0.03, 0.02, 0.01])
    got = kept(device_sampler.apply_top_p(logits, Tensor([0.7, 0.01])))
    assert got[0] == [0, 1, 2], (f"top_p 0.7 over [0.25, 0.25, 0.4, 0.1, ~0] keeps 2, then 0 and 1 (tied at 0.25, "
                                 f"both kept); kept {got[0]}")
    assert got[1] == [0], f"top_p 0.01 keeps the most likely token; kept {got[1]}"
    got = kept(device_sampler.apply_top_p(logits, Tensor([1.0, 1.0])))
    assert got == [[0, 1, 2, 3, 4]] * 2, f"top_p 1.0 filters nothing; kept {got}"


@pytest.mark.task("apply_top_p")
def test_top_p_in_the_sampler_graph():
    logits = log_probs([0.05, 0.5, 0.05, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2])
    thresholds = device_sampler.filter_thresholds(logits, Tensor([1.0, 1.0]), Tensor([5, 5]), Tensor([0.7, 1.0]),
                                                  Tensor([0.0, 0.0])).numpy()[:, 0]
    assert np.isclose(thresholds[0], np.log(0.3)) and thresholds[1] == -math.inf, (
        f"filter_thresholds (the engine's sampling graph) with top_p 0.7 over [0.05, 0.5, 0.05, 0.3, 0.1] should "
        f"keep logits >= log(0.3) = {np.log(0.3):.4f}, and filter nothing with top_p 1; thresholds {thresholds}")
