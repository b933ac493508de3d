"""Who did what: one record per request (`RequestRecord`, in the `current_record` context variable), written to
`--audit-log` by a thread and counted per API key; the key itself is never written.
Taught in docs/phases/09-appendix-limits-and-keys.md.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def route_path(scope: Scope) -> str:
    """The request's path without the server's --root-path prefix, when it came with it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


@dataclass
class RequestRecord:
    method: str
    route: str
    arrival: float  # time.time(), for the log
    key_id: str | None = None  # None: no valid key
    status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    disconnected: bool = False
    request_id: str | None = None
    complete: bool = False

    def line(self) -> str:
        when = datetime.fromtimestamp(self.arrival, timezone.utc).isoformat(timespec="milliseconds")
        return json.dumps({"time": when.replace("+00:00", "Z"), "key_id": self.key_id, "method": self.method,
                           "route": self.route, "status": self.status, "prompt_tokens": self.prompt_tokens,
                           "completion_tokens": self.completion_tokens, "latency_s": round(self.latency_s, 6),
                           "disconnected": self.disconnected, "request_id": self.request_id})


current_record: ContextVar[RequestRecord | None] = ContextVar("tinyvllm_request_record", default=None)


class AuditLog:
    """Appends one JSON line per record to `path`, on a thread of its own."""

    def __init__(self, path: str | Path):
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.queue: queue.SimpleQueue[RequestRecord | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.run, name="audit-log", daemon=True)
        self.thread.start()

    def write(self, record: RequestRecord) -> None:
        self.queue.put(record)

    def run(self) -> None:
        while True:
            records = [self.queue.get()]
            while not self.queue.empty():  # a burst: one write and one flush
                records.append(self.queue.get())
            lines = [record.line() + "\n" for record in records if record is not None]
            self.file.write("".join(lines))
            self.file.flush()
            if None in records:
                return

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(10)
        self.file.close()


class RequestAccounting:
    """ASGI middleware, outermost: a record per request, finished however the request ends."""

    def __init__(self, app: ASGIApp, *, audit_log: AuditLog | None, key_metrics, skip_paths: tuple[str, ...]):
        self.app, self.audit_log, self.key_metrics, self.skip_paths = app, audit_log, key_metrics, skip_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self.skip_paths:
            return await self.app(scope, receive, send)
        record = RequestRecord(scope["method"], scope["path"], time.time())
        start = time.monotonic()

        async def watch_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not record.complete:
                record.disconnected = True
            return message

        async def watch_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record.complete = True
            try:
                await send(message)
            except OSError:  # the client has gone (how ASGI 2.4 servers say it)
                record.disconnected = True
                raise

        reset = current_record.set(record)
        try:
            await self.app(scope, watch_receive, watch_send)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            current_record.reset(reset)
            record.latency_s = time.monotonic() - start
            if self.key_metrics is not None and record.key_id is not None:
                self.key_metrics.record(record.key_id, record.status, record.prompt_tokens, record.completion_tokens)
            if self.audit_log is not None:
                self.audit_log.write(record)
