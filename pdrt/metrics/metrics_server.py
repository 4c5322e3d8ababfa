"""The controller's metrics port: Prometheus text over HTTP, from prometheus_client's own server thread.

The thread only ever reads the aggregator's latest snapshot (a list replaced
whole), so serving a scrape never waits for, or races with, the controller.
A port that cannot be bound is logged and left off: metrics are not worth
failing the control plane for.
"""

import asyncio
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric

log = structlog.get_logger(__name__)


class _Latest:
    def __init__(self, snapshot: Callable[[], list[Metric]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> list[Metric]:
        return self.snapshot()


class MetricsServer:
    def __init__(self, host: str, port: int, snapshot: Callable[[], list[Metric]]) -> None:
        self.host, self.port = host, port
        self.registry = CollectorRegistry()
        self.registry.register(_Latest(snapshot))
        self.server: WSGIServer | None = None

    def start(self) -> None:
        try:
            self.server, _ = start_http_server(self.port, self.host, self.registry)
        except OSError as exc:
            log.warning("metrics port not served", host=self.host, port=self.port, error=str(exc))
            return
        log.info("metrics served", url=f"http://{self.host}:{self.port}/metrics")

    async def close(self) -> None:
        if self.server is not None:
            await asyncio.to_thread(self.server.shutdown)  # waits out the server loop's poll (up to 0.5 s)
            self.server.server_close()

