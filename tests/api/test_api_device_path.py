"""One request through the OpenAI API with the engine on the discrete GPU's path (tinyvllm/platforms.py,
tests/test_device_path.py): the text the CPU path gives offline."""

from __future__ import annotations

import pytest

from tinyvllm import platforms
from tinyvllm.sampling_params import SamplingParams

PROMPT = "The capital of France is"


@pytest.mark.slow
def test_server_on_the_discrete_path(tiny_model_dir, monkeypatch):
    """One request through the OpenAI API, the engine on the discrete path: the offline CPU path's text."""
    from api_helpers import client, serve

    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.llm import LLM

    args = dict(max_model_len=128, kv_cache_memory="4MiB", max_num_seqs=4, max_num_batched_tokens=32)
    offline = LLM(tiny_model_dir, **args).generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))
    monkeypatch.setattr(platforms, "DEVICE_PATH", "discrete")
    with serve(lambda: LLMEngine(tiny_model_dir, **args)) as server:
        c = client(server)
        response = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=8,
                                        temperature=0)
        engine = server.async_engine.engine
    assert response.choices[0].text == offline[0].outputs[0].text
    runner = engine.model_runner
    assert all(b._staged for bs in runner._token_inputs.values() for b in bs)
    assert all(b._staged for b in runner._logits_indices.values())
