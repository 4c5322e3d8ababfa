"""The UDP endpoint beside the gateway: datagrams in, accepted session ids out to a callback."""

import asyncio
import socket
from collections.abc import Callable

import structlog

from pdrt.errors import ConfigError
from pdrt.warmup.guard import WarmupGuard

log = structlog.get_logger(__name__)

RECEIVE_BUFFER_BYTES = 4 << 20


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, guard: WarmupGuard, on_warmup: Callable[[str], None]) -> None:
        self.guard = guard
        self.on_warmup = on_warmup

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        session_id = self.guard.check(data, addr[0])
        if session_id is not None:
            self.on_warmup(session_id)

    def error_received(self, exc: Exception) -> None:
        log.debug("warmup socket error", error=str(exc))


class WarmupListener:
    def __init__(self, host: str, port: int, guard: WarmupGuard, on_warmup: Callable[[str], None]) -> None:
        self.host, self.port = host, port
        self.guard = guard
        self.on_warmup = on_warmup
        self.transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.transport, _ = await loop.create_datagram_endpoint(
                lambda: _Protocol(self.guard, self.on_warmup), local_addr=(self.host, self.port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on udp://{self.host}:{self.port}: {exc.strerror or exc}") from exc
        sock = self.transport.get_extra_info("socket")
        # Bursts of focus events (or a flood) should queue in the kernel, not be lost before we read them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        self.port = self.transport.get_extra_info("sockname")[1]
        log.info("warmup listening", address=f"udp://{self.host}:{self.port}")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
