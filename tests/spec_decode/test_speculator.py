"""Which running requests get drafts (tinyvllm/spec_decode/speculator.py `speculates`): one that decodes a single
token the device sampler draws; a prompt still being computed, a grammar, penalties, logit bias, logprobs or
min_tokens not reached yet keep a request to one token a step."""

from __future__ import annotations

from tinyvllm.core.sequence import Sequence
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.speculator import speculates


def decoding(params: SamplingParams) -> Sequence:
    seq = Sequence("s", [1, 2, 3], params)
    seq.num_computed_tokens = 2  # the prompt's last token is this step's one token
    return seq


def test_a_plain_decode_speculates():
    params = SamplingParams(temperature=0.7, top_p=0.9)
    assert speculates(decoding(params), params, has_grammar=False)
    assert not speculates(Sequence("p", [1, 2, 3], params), params, has_grammar=False)  # its prompt runs first
    assert not speculates(decoding(params), params, has_grammar=True)


def test_what_the_device_sampler_cannot_draw_does_not():
    for params in (SamplingParams(logprobs=1), SamplingParams(presence_penalty=0.5),
                   SamplingParams(logit_bias={7: 2.0}), SamplingParams(min_tokens=4)):
        assert not speculates(decoding(params), params, has_grammar=False), params
