"""Phase 9's graders: server-sent events, and the non-streaming route's race against the client's disconnect
(course/phase9/). No server: a pydantic model, and a fake ASGI request whose `receive` says when the client left."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel

from tinyvllm.api import serving_engine


class Chunk(BaseModel):
    id: str
    usage: dict | None = None


# ---- sse ----

@pytest.mark.task("sse")
def test_an_event_is_data_json_and_a_blank_line():
    got = serving_engine.sse({"a": 1})
    assert got == 'data: {"a": 1}\n\n', f"a dict: 'data: ' + json.dumps(chunk) + two newlines; got {got!r}"
    got = serving_engine.sse("[DONE]")
    assert got == "data: [DONE]\n\n", f"a str is the payload as it is; got {got!r}"


@pytest.mark.task("sse")
def test_a_model_leaves_out_usage_only_when_none():
    got = serving_engine.sse(Chunk(id="c1"))
    assert got == 'data: {"id":"c1"}\n\n', f"a chunk without usage leaves the field out; got {got!r}"
    got = serving_engine.sse(Chunk(id="c2", usage={"total_tokens": 3}))
    assert json.loads(got.removeprefix("data: ")) == {"id": "c2", "usage": {"total_tokens": 3}}, (
        f"a chunk with usage keeps it; got {got!r}")
    got = serving_engine.sse_error(ValueError("bad"))
    assert got.startswith('data: {"error"') and got.endswith("\n\n"), f"the error event goes through sse; {got!r}"


# ---- last_output ----

class FakeRequest:
    """An ASGI request whose body was read: `receive` waits until `disconnect_after` seconds (None: never)."""

    def __init__(self, disconnect_after: float | None):
        self.disconnect_after = disconnect_after

    async def receive(self) -> dict:
        if self.disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.disconnect_after)
        return {"type": "http.disconnect"}


def outputs(count: int, delay: float, closed: list):
    async def stream():
        try:
            for i in range(count):
                await asyncio.sleep(delay)
                yield f"output {i}"
        finally:
            closed.append(True)  # the engine's stream aborts the request here when it did not finish
    return stream()


@pytest.mark.task("last_output")
def test_the_last_output_when_the_client_stays():
    closed: list = []
    got = asyncio.run(serving_engine.last_output(FakeRequest(None), outputs(3, 0.001, closed)))
    assert got == "output 2", f"a stream of 3 outputs, the client connected: the last one, got {got!r}"


@pytest.mark.task("last_output")
def test_a_disconnect_stops_the_stream():
    closed: list = []

    async def run():
        task = serving_engine.last_output(FakeRequest(0.05), outputs(1000, 0.01, closed))
        got = await asyncio.wait_for(task, timeout=5)
        return got, bool(closed)  # on return, not later when asyncio.run cleans up

    got, closed_on_return = asyncio.run(run())
    assert got is None, f"the client left after 50 ms of a 10 s stream: None, got {got!r}"
    assert closed_on_return, ("the stream was still open when last_output returned: cancel the consumer and wait for "
                              "it, so that the stream's finally aborts the request")


@pytest.mark.task("last_output")
def test_no_task_is_left_behind():
    async def run():
        await serving_engine.last_output(FakeRequest(None), outputs(2, 0.001, []))
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    left = asyncio.run(run())
    assert not left, f"the disconnect watcher is still running after the answer: cancel it ({left})"
