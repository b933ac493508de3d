"""AsyncLLMEngine without HTTP: the engine thread, the streams, aborts, and failures, on `FakeLLMEngine`."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeLLMEngine, run_offline

from tinyvllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, EngineNotReadyError
from tinyvllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def run(test, fake: FakeLLMEngine | None = None, **kwargs):
    """Run `test(engine, fake)` on a fresh event loop with a started AsyncLLMEngine around `fake`."""
    fake = fake or FakeLLMEngine()

    async def main():
        engine = AsyncLLMEngine(lambda: fake, **kwargs)
        engine.start()
        for _ in range(500):
            if engine.is_ready:
                break
            await asyncio.sleep(0.01)
        try:
            return await asyncio.wait_for(test(engine, fake), 60)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def collect(stream) -> list:
    return [output async for output in stream]


def test_stream_is_cumulative_and_ends_finished():
    async def test(engine, fake):
        return await collect(engine.generate("Hello", GREEDY, "r1"))

    outputs = run(test)
    expected = run_offline(FakeLLMEngine(), "Hello", GREEDY)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert outputs[-1].outputs[0].text == expected.outputs[0].text
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == len(expected.outputs[0].token_ids)


def test_n_fans_out_and_merges_by_index():
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=5)

    async def test(engine, fake):
        return (await collect(engine.generate("Hello", params, "r1")))[-1]

    final = run(test)
    assert [c.index for c in final.outputs] == [0, 1, 2] and final.request_id == "r1"
    for i, completion in enumerate(final.outputs):
        alone = run_offline(FakeLLMEngine(), "Hello", SamplingParams(seed=11 + i, temperature=1.0, max_tokens=5))
        assert completion.token_ids == alone.outputs[0].token_ids


def test_leaving_the_stream_aborts_the_request():
    async def test(engine, fake):
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async for output in engine.generate("Hello", params, "r1"):
            if len(output.outputs[0].token_ids) >= 2:
                break
        for _ in range(500):
            if fake.aborted:
                break
            await asyncio.sleep(0.01)
        return fake

    fake = run(test, FakeLLMEngine(step_time=0.01))
    assert fake.aborted == ["r1"] and fake.num_free_blocks == fake.num_total_blocks


def test_abort_is_applied_before_the_next_step():
    """The step in flight when the client leaves completes; the abort is drained before the one after."""

    async def test(engine, fake):
        stream = engine.add_request("r1", "Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        consumer = asyncio.ensure_future(collect(stream))
        while not fake.running or fake.num_steps < 2:
            await asyncio.sleep(0.005)
        fake.gate.clear()
        await asyncio.to_thread(fake.at_gate.wait, 10)  # the engine thread is inside a step now
        steps_before = fake.num_steps
        consumer.cancel()  # what a disconnect does to the task writing the response
        await asyncio.gather(consumer, return_exceptions=True)
        fake.gate.set()
        while not fake.aborted:
            await asyncio.sleep(0.005)
        return fake.num_steps - steps_before, fake

    steps, fake = run(test, FakeLLMEngine(step_time=0.01))
    assert steps == 1 and fake.num_free_blocks == fake.num_total_blocks


def test_bad_input_fails_only_that_request():
    async def test(engine, fake):
        with pytest.raises(ValueError, match="context length"):
            await collect(engine.generate("word " * 300, GREEDY, "too-long"))
        first = engine.add_request("same", "Hello", GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("same", "Hello", GREEDY)
        return (await collect(first))[-1]

    assert run(test).finished


def test_the_loop_survives_a_failing_abort_and_a_failing_step():
    class BrokenAbort(FakeLLMEngine):
        def abort_request(self, request_id):
            super().abort_request(request_id)
            raise RuntimeError("abort is broken")

    async def test(engine, fake):
        async for _ in engine.generate("Hello", SamplingParams(max_tokens=100, ignore_eos=True), "r1"):
            break
        fake.fail_next_step = True
        with pytest.raises(RuntimeError, match="engine failed"):
            await collect(engine.generate("Hello", GREEDY, "r2"))
        final = (await collect(engine.generate("Hello", GREEDY, "r3")))[-1]
        return final, fake.aborted

    final, aborted = run(test, BrokenAbort(step_time=0.005))
    assert final.finished and aborted[0] == "r1"


def test_not_ready_then_dead():
    async def main():
        engine = AsyncLLMEngine(lambda: FakeLLMEngine())
        with pytest.raises(EngineNotReadyError):
            engine.check_can_accept()
        engine.start()
        for _ in range(500):
            if engine.is_ready:
                break
            await asyncio.sleep(0.01)
        fake = engine.engine
        fake.gate.clear()  # hold the engine in a step while the server shuts down
        stream = engine.add_request("r1", "Hello", GREEDY)
        waiter = asyncio.ensure_future(collect(stream))
        await asyncio.sleep(0.1)
        shutting_down = asyncio.ensure_future(engine.shutdown())
        await asyncio.sleep(0.1)
        fake.gate.set()
        await shutting_down
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 10)
        with pytest.raises(EngineDeadError):
            engine.check_can_accept()

    asyncio.run(main())
