"""The engine keeps requests, steps and outputs; the sampler, a request's text, failures and the prompt's checks live
in modules of their own (docs/modules.md). A line budget keeps llm_engine.py readable in one sitting."""

from pathlib import Path

LLM_ENGINE = Path(__file__).resolve().parents[1] / "tinyvllm" / "engine" / "llm_engine.py"
MAX_LINES = 300


def test_llm_engine_stays_within_its_line_budget():
    lines = len(LLM_ENGINE.read_text().splitlines())
    assert lines <= MAX_LINES, (f"tinyvllm/engine/llm_engine.py has {lines} lines, more than {MAX_LINES}: move the new "
                                f"concept into the module where it belongs (sample/, engine/request_state.py, ...)")
