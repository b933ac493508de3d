"""The parts `LLMEngine` is assembled from, each on its own: the input processor (a request checked before it runs),
the output processor and its text streams (tokens to text, stop strings), the parent of n > 1 completions, the
engine core's step, a failed step retried in parts, the engine's state for the dashboard, and the step timer."""

from __future__ import annotations

import math

import pytest

from tinyvllm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.engine_state import engine_state, engine_stats
from tinyvllm.engine.failures import retry_in_parts
from tinyvllm.engine.input_processor import InputProcessor
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.parent_request import child_params
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.jit import Eager
from tinyvllm.model.tokenizer import load_tokenizer
from tinyvllm.model.weights import default_model_path
from tinyvllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                     kv_cache_memory="8MiB")


def test_the_input_processor_refuses_what_cannot_run(tokenizer):
    processor = InputProcessor(tokenizer, max_model_len=16)
    request = processor.process("r", "Hello there", SamplingParams(max_tokens=4), 0, in_use=lambda _: False)
    assert request.prompt_token_ids == tokenizer.encode("Hello there")
    with pytest.raises(ValueError, match="empty"):
        processor.process_prompt([])
    with pytest.raises(ValueError, match="max_model_len"):
        processor.process_prompt(list(range(16)))  # no room left for output
    with pytest.raises(ValueError, match="prompt token ids"):
        processor.process_prompt([tokenizer.vocab_size])
    with pytest.raises(ValueError, match="stop_token_ids"):
        processor.check_params(SamplingParams(stop_token_ids=[tokenizer.vocab_size + 3]))
    with pytest.raises(ValueError, match="priority"):
        processor.process("r", "Hi", SamplingParams(), "high", in_use=lambda _: False)


def test_logprobs_past_max_logprobs_are_refused_in_vllms_words(tokenizer):
    default, whole = InputProcessor(tokenizer, 16), InputProcessor(tokenizer, 16, max_logprobs=-1)
    assert default.num_logprobs("sample", 20) == 20 and default.num_logprobs("prompt", None) is None
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        default.check_params(SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match=f"Requested prompt logprobs of {tokenizer.vocab_size}, .* max allowed: 20"):
        default.check_params(SamplingParams(prompt_logprobs=-1))  # -1: the whole vocabulary
    assert whole.num_logprobs("prompt", -1) == whole.max_logprobs == tokenizer.vocab_size
    whole.check_params(SamplingParams(prompt_logprobs=-1, logprobs=500))


def test_the_engine_seed_seeds_requests_that_give_none(tokenizer):
    def seeds(engine_seed: int, params: SamplingParams) -> list:
        processor = InputProcessor(tokenizer, 16, seed=engine_seed)
        return [processor.process(f"r{i}", "Hi", params, 0, lambda _: False).params.seed for i in range(3)]

    random = SamplingParams(temperature=0.8)
    assert seeds(0, random) == seeds(0, random) != seeds(1, random)  # a rerun samples the same text
    assert len(set(seeds(0, random))) == 3  # each request its own stream
    assert seeds(0, SamplingParams(temperature=0.8, seed=7)) == [7, 7, 7]  # the request's own seed wins
    assert seeds(0, SamplingParams(temperature=0)) == [None] * 3  # greedy: nothing to seed


def test_enforce_eager_runs_the_same_tokens_without_graphs(tiny_model_dir):
    def run(**args):
        engine = LLMEngine(tiny_model_dir, max_model_len=64, kv_cache_memory="4MiB", **args)
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
        while engine.has_unfinished_requests():
            outputs = {o.request_id: o for o in engine.step()}
        return engine, outputs["r"].outputs[0].token_ids

    (captured, tokens), (eager, eager_tokens) = run(), run(enforce_eager=True)
    assert eager_tokens == tokens
    assert captured.model_runner.capture is not Eager and eager.model_runner.capture is Eager


@pytest.mark.phase9  # prompt logprobs are read from every position's hidden states (worker/hidden_states.py)
def test_prompt_logprobs_of_the_whole_vocabulary(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, max_model_len=64, kv_cache_memory="4MiB", max_logprobs=-1)
    vocab = engine.tokenizer.vocab_size
    engine.add_request("p", [1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=-1))
    while engine.has_unfinished_requests():
        outputs = {o.request_id: o for o in engine.step()}
    logprob, top = outputs["p"].prompt_logprobs[2]
    assert len(top) == vocab and logprob == dict(top)[3]  # every token's, the prompt's own among them
    assert abs(sum(math.exp(lp) for _, lp in top) - 1) < 1e-3


def test_a_text_stream_holds_back_a_possible_stop_string(tokenizer):
    ids = tokenizer.encode("The answer is 42. Done")
    stream = TextStream(tokenizer, SamplingParams(stop=[". Done"]))
    pieces = []
    for token in ids:
        piece, stopped = stream.add(token)
        pieces.append(piece)
        if stopped:
            break
    assert stopped and stream.stop_str == ". Done"
    assert "".join(pieces) == stream.text == "The answer is 42"
    plain = TextStream(tokenizer, SamplingParams())
    assert "".join(plain.add(t)[0] for t in ids) + plain.finish() == "The answer is 42. Done"


def test_the_output_processor_turns_core_outputs_into_request_outputs(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode(" one two three")
    processor.add_request("a", "count:", tokenizer.encode("count:"), SamplingParams(stop=[" two"]), 0.0)
    processor.add_request("b", "count:", tokenizer.encode("count:"), SamplingParams(), 0.0)
    outputs, to_abort = processor.process_outputs([EngineCoreOutput("a", new_token_ids=ids),
                                                   EngineCoreOutput("b", new_token_ids=ids[:1])])
    by_id = {out.request_id: out for out in outputs}
    assert to_abort == ["a"]  # its stop string: the core must stop it
    assert by_id["a"].finished and by_id["a"].outputs[0].text == " one"
    assert not by_id["b"].finished and by_id["b"].outputs[0].text == " one"
    assert set(processor.request_states) == {"b"}


def test_a_childs_seed_is_its_parents_plus_its_index():
    assert child_params(SamplingParams(n=3, seed=7), 2).seed == 9 and child_params(SamplingParams(n=3), 1).n == 1
    assert child_params(SamplingParams(n=2, seed=2**64 - 1), 1).seed == 0  # wraps in the 64-bit range
    assert child_params(SamplingParams(n=2), 1).seed is None


def test_a_failed_step_is_retried_one_sequence_at_a_time():
    seqs = [Sequence(name, [1, 2, 3], SamplingParams()) for name in ("a", "b", "c")]
    step = SchedulerOutput(seqs, {seq.seq_id: 3 for seq in seqs})

    def execute_model(part):
        if any(seq.seq_id == "b" for seq in part.scheduled_seqs):
            raise IndexError("b's row is past the buffer")
        return ModelRunnerOutput(sampled_token_ids={seq.seq_id: [5] for seq in part.scheduled_seqs})

    merged = retry_in_parts(step, IndexError("the whole step"), execute_model)
    assert merged.sampled_token_ids == {"a": [5], "c": [5]}
    assert list(merged.failed) == ["b"] and "past the buffer" in merged.failed["b"]


def test_the_engine_core_steps_a_request_to_its_end(engine):
    core = engine.engine_core
    assert isinstance(core, EngineCore)
    core.add_request("core-1", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0))
    tokens, finished = [], False
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
            finished = finished or out.finished
    assert len(tokens) == 3 and finished
    assert engine_stats(engine)["num_running"] == 0


def test_the_engine_state_shows_a_running_requests_blocks(engine):
    engine.add_request("state-1", list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0.0))
    engine.step()
    state = engine_state(engine)
    stats = engine_stats(engine)
    assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_total_blocks"]
    assert "state-1" in str(state)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine_stats(engine)["num_running"] == 0


@pytest.mark.phase6  # the step profile came with Phase 6's measurements
def test_the_step_timer_charges_each_phase_its_time(monkeypatch):
    from tinyvllm.engine.step_timer import StepTimer

    clock = iter([0.0, 0.001, 0.004, 0.010, 0.011])
    monkeypatch.setattr("tinyvllm.engine.step_timer.time.perf_counter", lambda: next(clock))
    timer = StepTimer()
    timer.start()
    timer.lap("schedule")
    timer.lap("forward")
    timer.lap("schedule")
    ms = timer.per_step_ms()
    assert list(ms) == ["schedule", "forward"]
    assert ms["schedule"] == pytest.approx(1.0 + 6.0) and ms["forward"] == pytest.approx(3.0)
    timer.lap("custom")
    assert list(timer.per_step_ms()) == ["schedule", "forward", "custom"]
