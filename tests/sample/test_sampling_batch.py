"""The step's sampling rows (tinyvllm/sample/sampling_batch.py): which requests the device sampler cannot serve
(they go to the host's reference sampler), and the message a request that failed ends with."""

from __future__ import annotations

from tinyvllm.core.sequence import Sequence
from tinyvllm.sample.sampling_batch import failure_message, needs_host_sampler
from tinyvllm.sampling_params import SamplingParams


def test_what_the_device_sampler_leaves_to_the_host():
    seq = Sequence("s", [1, 2, 3], SamplingParams())
    assert not needs_host_sampler(seq, SamplingParams(temperature=0.8, top_k=20, top_p=0.9))
    assert needs_host_sampler(seq, SamplingParams(logprobs=2))
    assert needs_host_sampler(seq, SamplingParams(repetition_penalty=1.2))
    assert needs_host_sampler(seq, SamplingParams(logit_bias={5: 1.0}))
    assert needs_host_sampler(seq, SamplingParams(min_tokens=2))  # no output yet: EOS must be masked


def test_a_failure_names_its_error():
    assert failure_message(KeyError("row 3")) == "the engine failed while running this request: KeyError: 'row 3'"
