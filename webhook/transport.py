"""How admission requests reach the app: connections, TLS and listening.

What a client can hold of the server is bounded (``ServerLimits``): ``listen`` puts a thin
protocol in front of aiohttp's for each connection, which caps the number of connections and
enforces the header timeout; aiohttp closes idle keep-alive connections; asyncio drops slow TLS
handshakes. The endpoint bounds each body (``webhook.bodies``). An abuser therefore costs a
bounded amount of memory, and the API server's own connections, which send a request as soon as
they connect, keep being served.

What a client can make the event loop do in one piece is bounded too: the unread rest of a
large body answered early (413, 408, 503, 400) is not read, since decrypting it would cost the
loop for nothing; and connections are read into one shared buffer. Our per-connection objects
hold no reference cycle, so a closed connection is freed at once, not by a full run of the
cyclic collector with hundreds of others (tens of milliseconds in one piece).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

from webhook.bodies import LARGE_BODY_BYTES
from webhook.config import ServerLimits
from webhook.heap import return_large_blocks_at_once
from webhook.metrics import AdmissionMetrics

log = logging.getLogger(__name__)

# After an early answer (413, 408), how long to read and discard what the client still sends,
# so that it sees the answer instead of a reset (never longer than the body timeout).
LINGER_S = 2.0


class _ReadGate:
    """The transport as aiohttp sees it: the connection's own, except that reading stays
    paused once the connection drops the rest of a body. aiohttp resumes reading to linger
    after an early answer, and with TLS each resume decrypts what the socket holds. It keeps
    no reference to its connection, which would make a cycle."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.shut = False

    def resume_reading(self) -> None:
        if not self.shut:
            self._transport.resume_reading()

    def shut_reading(self) -> bool:
        """Pauses reading for good; whether it was open until now."""
        if self.shut or self._transport.is_closing():
            return False
        self.shut = True
        self._transport.pause_reading()
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# What a connection's data is read into before it is handed on (see _Connection.get_buffer):
# as large as one read of asyncio's TLS layer, and handed on in pieces below glibc's threshold
# for mapping allocations of their own (128 KiB here, see webhook.heap).
READ_BUFFER_BYTES = 256 * 1024
HANDED_ON_BYTES = 64 * 1024


class _Connection(asyncio.BufferedProtocol):
    """One client connection: forwards everything to aiohttp's protocol, and keeps what the
    guard needs (in progress or idle since when, served before or not, header deadline).

    A buffered protocol: asyncio's TLS layer then decrypts into one buffer shared by all
    connections (the event loop hands it to one at a time). Given a plain protocol it would
    allocate a 256 KiB buffer for each TLS record of 16 KiB and join them: with allocations of
    that size mapped and unmapped each time, a millisecond or more per 256 KiB received.
    """

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.gate: asyncio.Transport | None = None  # what aiohttp sees (the guard's key)
        self._reads: _ReadGate | None = None
        self.busy = 0  # requests whose headers arrived and whose answer is not sent yet
        self.served = 0
        self.last_active = 0.0
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._reads = _ReadGate(transport)
        # Duck-typed: it answers every Transport method by the real transport's.
        self.gate = cast(asyncio.Transport, self._reads)
        self.inner.connection_made(self.gate)
        self.guard.opened(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.guard.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        view = self.guard.read_buffer
        for start in range(0, nbytes, HANDED_ON_BYTES):
            # aiohttp may keep what it is given: a copy, not a view of the shared buffer.
            self.data_received(bytes(view[start : min(nbytes, start + HANDED_ON_BYTES)]))

    def data_received(self, data: bytes) -> None:
        if self._reads is not None and self._reads.shut:
            return  # the rest of a body answered early, decrypted before reading paused
        self.last_active = self.guard.now()
        if not self.busy and self._header_timer is None and self.transport is not None:
            self._header_timer = self.guard.header_deadline(self)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_header_timer()
        self.guard.closed(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def start_header_timer(self) -> None:
        self._header_timer = self.guard.header_deadline(self)

    def abort(self) -> None:
        self.cancel_header_timer()
        if self.transport is not None:
            self.transport.abort()

    def drop_rest(self) -> None:
        """Reads nothing more: the answer is on its way, and the client has LINGER_S to read it
        (an HTTP/1.1 client reads the answer while it still sends, as Go's does) before the
        connection is reset. Reading the rest would cost the event loop the decryption of up
        to ``max_body_bytes`` for nothing, and a graceful TLS close would read it too."""
        if self._reads is None or not self._reads.shut_reading():
            return
        asyncio.get_running_loop().call_later(LINGER_S, self.guard.close, self, "unread-body")


class ConnectionGuard:
    """The cap on connections and the header timeout, shared by the site and the app."""

    def __init__(self, limits: ServerLimits, metrics: AdmissionMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.open: dict[asyncio.BaseTransport, _Connection] = {}
        self.read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def opened(self, conn: _Connection) -> None:
        assert conn.gate is not None
        conn.last_active = self.now()
        self.open[conn.gate] = conn
        self.metrics.connections.set(len(self.open))
        conn.start_header_timer()
        if len(self.open) <= self.limits.max_connections:
            return
        idle = [c for c in self.open.values() if not c.busy and c is not conn]
        if idle:
            # Never-used connections go first: an API server sends a request right after it
            # connects, so one that never did is the likeliest abuser.
            victim = min(idle, key=lambda c: (c.served > 0, c.last_active))
            self._close(victim, "evicted")
        else:
            self._close(conn, "refused")

    def closed(self, conn: _Connection) -> None:
        if conn.gate is not None and self.open.pop(conn.gate, None) is not None:
            self.metrics.connections.set(len(self.open))

    def header_deadline(self, conn: _Connection) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(
            self.limits.header_timeout_seconds, self._close, conn, "header-timeout"
        )

    def close(self, conn: _Connection, reason: str) -> None:
        """Closes ``conn`` now (a reset), unless it is closed already."""
        if conn.gate in self.open:
            self._close(conn, reason)

    def _close(self, conn: _Connection, reason: str) -> None:
        self.metrics.connections_closed.labels(reason).inc()
        log.info(
            "closing a client connection",
            extra={
                "reason": reason,
                "open": len(self.open),
                "max_connections": self.limits.max_connections,
            },
        )
        self.closed(conn)
        conn.abort()

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.BufferedProtocol]:
        return lambda: _Connection(server(), self)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        conn = self.open.get(request.transport) if request.transport is not None else None
        if conn is None:  # served through a site other than ``listen``'s (tests of the app)
            return await handler(request)
        conn.cancel_header_timer()
        conn.busy += 1
        try:
            response = await handler(request)
            if not request.content.is_eof() and (
                request.content_length is None or request.content_length > LARGE_BODY_BYTES
            ):
                conn.drop_rest()
            return response
        finally:
            conn.busy -= 1
            conn.served += 1
            conn.last_active = self.now()


GUARD = web.AppKey("connection_guard", ConnectionGuard)


class _GuardedSite(web.BaseSite):
    """A TLS site whose connections pass through the guard, with a TLS handshake timeout
    (``TCPSite`` takes neither a protocol wrapper nor the handshake timeout)."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext,
        guard: ConnectionGuard,
        backlog: int,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.host, self.port = host, port
        self.guard = guard

    @property
    def name(self) -> str:
        return f"https://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.protocol_factory(server),
            self.host,
            self.port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
            ssl_handshake_timeout=self.guard.limits.handshake_timeout_seconds,
        )
        self.port = self._server.sockets[0].getsockname()[1]


@dataclass
class Listener:
    """A started admission server; ``port`` is the bound one (useful when 0 was asked)."""

    runner: web.AppRunner
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def listen(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext
) -> Listener:
    """Serves ``app`` (from ``build_app``) over TLS with the limits it was built with."""
    # What exists now (modules, configuration, clients) lives as long as the process: keep it
    # out of the cyclic collector, whose full passes over it would stall the event loop for
    # tens of milliseconds while large bodies churn allocations.
    gc.collect()
    gc.freeze()
    return_large_blocks_at_once()
    guard = app[GUARD]
    limits = guard.limits
    # Handlers are not cancelled when their client goes away (aiohttp's handler_cancellation
    # stays off): a quota reservation half made must finish, or be released, on its own terms.
    # A client that leaves mid-body is noticed where the body is read.
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=limits.idle_timeout_seconds,
        lingering_time=min(LINGER_S, limits.body_timeout_seconds),
    )
    await runner.setup()
    try:
        site = _GuardedSite(
            runner,
            host,
            port,
            ssl_context=ssl_context,
            guard=guard,
            # Connections not yet accepted wait in the kernel; a burst beyond this is dropped
            # there and retried by the client's TCP stack.
            backlog=min(limits.max_connections, 1024),
        )
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return Listener(runner, site.port)
