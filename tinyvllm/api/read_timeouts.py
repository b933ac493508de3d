"""Read timeouts: a client that sends part of its headers and waits gets 408 after `header_read_timeout`
(here, in uvicorn's h11 protocol; the body's limit is `RequestGuard.read_body`'s). uvicorn bounds only the idle time
between requests. Taught in docs/phases/09-appendix-server-defects.md.
"""

from __future__ import annotations

import asyncio
import functools

from uvicorn.protocols.http.h11_impl import H11Protocol

_BODY = b"the request headers came too slowly\n"
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing (408) a connection whose request headers take longer than
    `header_read_timeout` seconds to arrive."""

    def __init__(self, *args, header_read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_read_timeout = header_read_timeout
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.header_timer = self.loop.call_later(self.header_read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _timed_out(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        self.logger.warning("closing a connection whose request headers did not arrive within %g s",
                            self.header_read_timeout)
        self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def read_timeout_protocol(header_read_timeout: float):
    """The protocol class to give uvicorn.Config(http=...)."""
    if not header_read_timeout > 0:
        raise ValueError(f"header_read_timeout must be > 0 seconds, got {header_read_timeout}")
    return functools.partial(HeaderTimeoutH11Protocol, header_read_timeout=header_read_timeout)
