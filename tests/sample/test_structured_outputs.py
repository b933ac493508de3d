"""Structured outputs: whatever the model would say, the output follows the grammar.

A tiny model with random weights is the hardest case (it has no idea what JSON is): every token it may
pick comes from the grammar's mask, on the device sampler and on the host sampler alike. The real model
then shows the same on a request a user would send.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from test_engine import engine, run_all, tiny_dir  # noqa: F401  (module fixtures)
from tinyvllm.sample.structured_output import apply_bitmask_numpy
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
POINTS = {"type": "array", "maxItems": 3, "items": {"type": "object", "additionalProperties": False,
                                                     "required": ["x", "y"],
                                                     "properties": {"x": {"type": "boolean"}, "y": {"type": "null"}}}}


def check_person(value: dict) -> None:
    assert set(value) == {"name", "age", "role"} and isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and value["role"] in ("admin", "user", "guest")


def check_points(value: list) -> None:
    assert isinstance(value, list) and len(value) <= 3
    assert all(set(p) == {"x", "y"} and isinstance(p["x"], bool) and p["y"] is None for p in value)


CASES = {
    "person": (StructuredOutputsParams(json=PERSON), lambda text: check_person(json.loads(text))),
    "points": (StructuredOutputsParams(json=json.dumps(POINTS)), lambda text: check_points(json.loads(text))),
    "regex": (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
              lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) or pytest.fail(text)),
    "choice": (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")
               or pytest.fail(text)),
    "grammar": (StructuredOutputsParams(grammar='start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[1-9]/'),
                lambda text: re.fullmatch(r"\([1-9](\+[1-9])*\)", text) or pytest.fail(text)),
}


def test_the_host_mask_unpacks_the_bitmask_as_the_device_does():
    from tinygrad import Tensor

    from tinyvllm.sample import device_sampler

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 100)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    on_device = device_sampler.apply_token_bitmask(Tensor(logits), Tensor(bitmask)).numpy()
    for row in range(3):
        np.testing.assert_array_equal(on_device[row], apply_bitmask_numpy(logits[row], bitmask[row]))
        allowed = [(int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in range(100)]
        assert np.isfinite(on_device[row]).tolist() == [bool(a) for a in allowed]


def test_every_output_follows_its_grammar_on_a_random_model(engine):
    requests = {}
    for name, (constraint, _) in CASES.items():
        for i, extra in enumerate([dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=7,
                                   top_k=50, top_p=0.9), dict(temperature=0.8, seed=3, logprobs=2)]):  # last: host
            requests[f"{name}-{i}"] = ([100 + i, 200, 300],
                                       SamplingParams(max_tokens=120, structured_outputs=constraint, **extra))
    requests["free"] = ([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))  # no grammar
    outputs = run_all(engine, requests)
    for request_id, out in outputs.items():
        if request_id == "free":
            assert len(out.outputs[0].token_ids) == 20
            continue
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (request_id, completion.text)  # the grammar ended it
        CASES[request_id.rsplit("-", 1)[0]][1](completion.text)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("constraint, message", [
    (dict(regex="(("), "unclosed group"),
    (dict(json='{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'), "nope"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_a_grammar_that_does_not_compile_is_refused(engine, constraint, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad-grammar", [5, 6],
                           SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert "bad-grammar" not in engine.output_processor.request_states and not engine.has_unfinished_requests()


@pytest.mark.parametrize("fields", [{}, {"json": PERSON, "regex": "a"}, {"choice": []}, {"json": 5}])
def test_structured_outputs_params_need_exactly_one_valid_constraint(fields):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields)


@pytest.mark.slow
def test_the_real_model_fills_a_schema(generator):
    prompt = generator.encode_prompt("Describe a user of a web shop as JSON with name, age and role.", chat=True)
    for params in (dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=1.0, seed=2)):
        result = generator.generate(prompt, SamplingParams(max_tokens=60, structured_outputs=StructuredOutputsParams(
            json=PERSON), **params))
        assert result.finish_reason == "stop", result.text
        check_person(json.loads(result.text))
