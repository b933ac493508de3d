"""Phase 9, tasks sse and last_output: the OpenAI server's two ways of answering, an event stream, and one body that
stops the work when the client hangs up.

The engine calls them as `tinyvllm.api.serving_engine.sse` (every chunk of a streamed `/v1/completions` and
`/v1/chat/completions`, and the error event after the stream began) and `.last_output` (the same routes with
`"stream": false`: the request's stream joined, raced against the client's disconnect). Chapter:
docs/phases/09-api-server.md ("Build it"). Grade: make course P=9
"""

from __future__ import annotations

import asyncio  # noqa: F401  (yours to use)
import json  # noqa: F401  (yours to use)

from pydantic import BaseModel

from tinyvllm.api.serving_engine import wait_for_disconnect  # noqa: F401  (yours to use)


def sse(chunk: BaseModel | dict | str) -> str:
    """One server-sent event: "data: " + the chunk as JSON + a blank line ("\\n\\n" ends an event).

    A pydantic model: `chunk.model_dump_json()`, leaving out its `usage` field when that is None (OpenAI's
    streamed chunks carry usage only where it has a value: `model_dump_json(exclude={"usage"})`). A dict:
    `json.dumps(chunk)`. A str is already the payload. `sse({"a": 1})` == 'data: {"a": 1}\\n\\n'.
    """
    raise NotImplementedError("course/phase9/serving.py: sse is yours to write")


async def last_output(request, stream):
    """The last output of `stream` (an async iterator of a request's cumulative RequestOutputs), or None when the
    client disconnects first.

    Run two tasks (`asyncio.ensure_future`): one consumes `stream` to its end, keeping the last output; the other is
    `wait_for_disconnect(request)`, which returns when the client closes the connection. Wait for the first to
    finish (`asyncio.wait(..., return_when=asyncio.FIRST_COMPLETED)`). Then, always (`finally`): cancel the
    disconnect watcher, and if the consumer is still running, cancel it and wait for it to wind up
    (`asyncio.gather(consumer, return_exceptions=True)`): the cancellation reaches the stream, whose own `finally`
    aborts the request in the engine, so a request nobody waits for stops taking GPU time at the next step.
    """
    raise NotImplementedError("course/phase9/serving.py: last_output is yours to write")
