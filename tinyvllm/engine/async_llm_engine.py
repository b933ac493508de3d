"""The async engine (vLLM v0's `AsyncLLMEngine`): one thread builds and owns the engine and steps it, the event loop
owns the clients, and the two meet only at queues: a thread-safe input queue drained before every step, and an
asyncio.Queue per request filled through `call_soon_threadsafe`.

Taught in docs/phases/09-api-server.md, sections 1 and 2.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tinygrad_ext.startup import share_kernel_cache_across_threads

logger = logging.getLogger("tinyvllm.engine")


class EngineNotReadyError(RuntimeError):
    """The engine is still being built (weights loading, kernels compiling), or failed to build."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (the server is shutting down)."""


class EngineStepError(RuntimeError):
    """A step failed for this request alone."""


class EngineOverloadedError(RuntimeError):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0


@dataclass
class _Abort:
    request_id: str


@dataclass
class _GetState:
    future: concurrent.futures.Future  # set on the engine thread, awaited on the event loop


@dataclass
class _AbortAll:
    error: BaseException  # what each request in the engine ends with


_SHUTDOWN = object()


class AsyncLLMEngine:
    """`generate()` streams one request's outputs; everything device-side happens on `engine-loop`. stat_logger is
    called on the engine thread."""

    def __init__(self, engine_factory: Callable[[], object], *, max_waiting: int | None = None,
                 stat_logger: object | None = None, retry_after: int = 1):
        self.engine_factory = engine_factory
        self.max_waiting = max_waiting  # more requests than this waiting -> EngineOverloadedError
        self.retry_after = retry_after
        self.stat_logger = stat_logger
        self.engine = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None  # called on the engine thread
        self.stats: dict = {"num_running": 0, "num_waiting": 0}  # republished every loop turn
        self._input: queue.Queue = queue.Queue()  # event loop -> engine thread
        self._routes: dict[str, asyncio.Queue] = {}  # request id -> its stream; event loop only
        self._in_engine: set[str] = set()  # engine thread only
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.draining = False

    # ---- lifecycle (event loop side) ----

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_engine_loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._input.put(_SHUTDOWN)
            await asyncio.to_thread(self._thread.join, timeout)

    def drain(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests, give the ones in flight `timeout` seconds, then end those left with
        an error."""
        if self._loop is not None and not self.draining:
            self._loop.call_soon_threadsafe(self._start_draining, timeout)

    def _start_draining(self, timeout: float) -> None:
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d requests in flight get %g s to finish", len(self._routes), timeout)
        error = EngineDeadError(f"the server is shutting down: this request did not finish within the {timeout:g} s "
                                "grace period (--shutdown-timeout); retry it")
        self._loop.call_later(timeout, self._input.put, _AbortAll(error))

    async def get_state(self, timeout: float = 30.0) -> dict:
        """The engine's snapshot and stats, taken on the engine thread between two steps."""
        self.check_ready()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._input.put(_GetState(future))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    # ---- what the server reads of the engine ----

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def num_logprobs(self, kind: str, k: int | None) -> int | None:
        return self.engine.input_processor.num_logprobs(kind, k)

    @property
    def model_path(self) -> str | None:
        path = getattr(self.engine, "model_path", None)
        return None if path is None else str(path)

    @property
    def multimodal_processor(self):
        """Phase 10's MultiModalProcessor, for a model that takes images; else None."""
        return getattr(getattr(self.engine, "input_processor", None), "multimodal", None)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._thread is not None and self._thread.is_alive()

    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus commands not yet drained."""
        return self.stats["num_waiting"] + self._input.qsize()

    # ---- requests (event loop side) ----

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes (vLLM's signature)."""
        async for output in self.add_request(request_id, prompt, sampling_params, priority):
            yield output

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams,
                    priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue the request for the engine thread and return its stream of outputs; leaving the stream early aborts
        the request."""
        self.check_can_accept(sampling_params.n)
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        self._routes[request_id] = outputs
        self._input.put(_Add(request_id, prompt, sampling_params, time.monotonic(), priority))
        return self._stream(request_id, outputs)

    async def _stream(self, request_id: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                while not isinstance(item, BaseException) and not outputs.empty():
                    item = outputs.get_nowait()  # fell behind: the newest cumulative output says it all
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._routes.pop(request_id, None)
            if not finished:
                self._input.put(_Abort(request_id))

    def check_ready(self) -> None:
        if not self._ready.is_set():
            reason = f"failed to load: {self.load_error}" if self.load_error else "is still loading"
            raise EngineNotReadyError(f"the model {reason}")
        if not self.is_ready:
            raise EngineDeadError("the engine has stopped")

    def check_can_accept(self, n: int = 1) -> None:
        """Raise if `n` more requests can't be taken."""
        self.check_ready()
        if self.draining:
            raise EngineDeadError("the server is shutting down and takes no new requests; retry on another server")
        if self.max_waiting is not None and self.num_waiting() + n > self.max_waiting:
            self._record("record_admission_rejection")
            raise EngineOverloadedError(f"the server is overloaded: {self.num_waiting()} requests are already "
                                        f"waiting (max {self.max_waiting}); retry later", self.retry_after)

    def _dispatch(self, batch: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """On the event loop: hand each output to its request's queue."""
        for request_id, item in batch:
            last = isinstance(item, BaseException) or item.finished
            route = self._routes.pop(request_id, None) if last else self._routes.get(request_id)
            if route is not None:  # None: the client left
                route.put_nowait(item)

    def _fail_all_streams(self, error: BaseException) -> None:
        for request_id in list(self._routes):
            self._dispatch([(request_id, error)])

    # ---- the engine loop (engine thread) ----

    def _run_engine_loop(self) -> None:
        share_kernel_cache_across_threads()
        try:
            self.engine = self.engine_factory()
        except BaseException as e:
            self.load_error = e
            logger.exception("the engine failed to load")
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        self._ready.set()
        try:
            while self._run_once():
                pass
        finally:  # however the loop ends, no stream may wait forever for an output that won't come
            self._call_event_loop(self._fail_all_streams, EngineDeadError("the engine loop has stopped"))

    def _run_once(self) -> bool:
        """One turn: take the commands, then step if there is work; False once told to shut down."""
        idle = not self.engine.has_unfinished_requests()
        commands = [self._input.get()] if idle else []  # sleep until there is something to do
        while not self._input.empty():
            commands.append(self._input.get_nowait())
        if any(c is _SHUTDOWN for c in commands):
            self._abort_all(EngineDeadError("the server is shutting down"))
            return False
        errors = [error for c in commands if (error := self._apply(c)) is not None]
        self._publish(errors)
        if self.engine.has_unfinished_requests():
            self._step()
        return True

    def _apply(self, command: _Add | _Abort | _GetState | _AbortAll) -> tuple[str, BaseException] | None:
        if isinstance(command, _GetState):
            try:
                state = self.engine.get_state() if hasattr(self.engine, "get_state") else {}
                command.future.set_result({**state, "stats": self.engine.get_stats()})
            except Exception as e:  # a snapshot must never stop the engine
                command.future.set_exception(e)
            return None
        if isinstance(command, _AbortAll):
            self._abort_all(command.error)
            return None
        if isinstance(command, _Abort):
            if command.request_id in self._in_engine:
                self._abort(command.request_id)
            return None
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, priority=command.priority)
        except Exception as e:  # ValueError: the caller's mistake, answered to that request only
            return command.request_id, e
        self._in_engine.add(command.request_id)
        self._record("record_added", command.request_id, command.arrival_time, command.params)
        return None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # worse than the failures the engine isolates
            logger.exception("engine step failed; aborting the %d requests in the engine", len(self._in_engine))
            self._abort_all(EngineStepError(f"the engine failed while running this request: {type(e).__name__}"))
            return
        batch = []
        for output in outputs:
            if output.request_id not in self._in_engine:
                continue
            if output.error is not None:  # this request alone failed inside the step; the others go on
                self._abort(output.request_id)  # n > 1: its other completions
                batch.append((output.request_id, EngineStepError(output.error)))
                continue
            if output.finished:
                self._in_engine.discard(output.request_id)
            batch.append((output.request_id, _snapshot(output)))
        self._publish(batch, outputs, stepped=True)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # an engine that cannot abort must not take the loop down with it
            logger.exception("abort of %s failed", request_id)
        self._in_engine.discard(request_id)
        self._record("record_removed", request_id)

    def _abort_all(self, error: BaseException) -> None:
        batch = [(request_id, error) for request_id in self._in_engine]
        for request_id, _ in batch:
            self._abort(request_id)
        self._publish(batch)

    def _publish(self, batch: list, outputs: list[RequestOutput] = (), stepped: bool = False) -> None:
        self.stats = self.engine.get_stats()
        self._record("record", time.monotonic(), self.stats, outputs, stepped)
        if batch:
            self._call_event_loop(self._dispatch, batch)

    def _call_event_loop(self, function: Callable, *args) -> None:
        """The one door from this thread into the event loop."""
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the event loop has closed: nobody is left to read
            pass

    def _record(self, method: str, *args) -> None:
        if self.stat_logger is None:
            return
        try:
            getattr(self.stat_logger, method)(*args)
        except Exception:  # metrics must never stop the engine
            logger.exception("stat logger %s failed", method)


def _snapshot(output: RequestOutput) -> RequestOutput:
    """Copy the lists the engine keeps appending to, so the event loop reads a stable output."""
    outputs = [dataclasses.replace(o, token_ids=list(o.token_ids),
                                   logprobs=None if o.logprobs is None else list(o.logprobs))
               for o in output.outputs]
    return dataclasses.replace(output, prompt_token_ids=list(output.prompt_token_ids), outputs=outputs)
