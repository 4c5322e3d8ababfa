"""What the gateway's `/metrics` serves: its own metrics, live, and every other process's from the controller.

The gateway holds one `GatewayMetricsView`. `update` takes the controller's
`MetricsView` (at most once a second) and keeps its text; `exposition()`,
which parses the newest that parses (parsing every view took 8% of a busy
gateway's CPU, for a page scraped far less often), returns valid
Prometheus text (serve it with `CONTENT_TYPE`): this gateway's metrics as
they are now, plus the merged view less this gateway's own (older) samples,
each family once, every sample labelled with `process` and `role`.

The gateway's `Status.counters` (drafts, warmups, dropped datagrams and
messages) are exported too, read from `status()` when collected.
"""

from collections import deque
from collections.abc import Callable, Iterator

import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from pdrt.metrics.exposition import merge, parse, relabel, render
from pdrt.metrics.gateway_metrics import GatewayMetrics
from pdrt.wire import MetricsView, Status

log = structlog.get_logger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST  # what an HTTP reply of `exposition()` says it holds


class GatewayMetricsView:
    def __init__(self, metrics: GatewayMetrics, status: Callable[[], Status], process_id: str) -> None:
        self.registry = metrics.registry
        self.registry.register(_StatusCollector(status))
        self.process_id = process_id
        self.labels = {"process": process_id, "role": "gateway"}
        self.view: list[Metric] = []  # the controller's merged view, less this gateway
        self.unparsed: deque[bytes] = deque(maxlen=3)  # views that came since, newest last

    def update(self, view: MetricsView) -> None:
        self.unparsed.append(view.exposition)

    def _parse_newest(self) -> None:
        while self.unparsed:
            try:
                families = parse(self.unparsed.pop())
            except ValueError as exc:
                log.warning("gateway dropped a metrics view it could not parse", error=str(exc))
                continue
            self.unparsed.clear()
            self._take(families)

    def _take(self, families: list[Metric]) -> None:
        self.view = []
        for family in families:
            others = [s for s in family.samples if s.labels.get("process") != self.process_id]
            if others:
                copy = Metric(family.name, family.documentation, family.type, family.unit)
                copy.samples = others
                self.view.append(copy)

    def exposition(self) -> bytes:
        """Prometheus text of the whole node, this gateway's part live."""
        self._parse_newest()
        return render(merge([relabel(self.registry.collect(), self.labels), self.view]))


class _StatusCollector:
    def __init__(self, status: Callable[[], Status]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        counters = dict(status.counters)
        yield GaugeMetricFamily("pdrt_gateway_open_requests", "Requests open at the gateway",
                                value=status.num_open_requests)
        yield GaugeMetricFamily("pdrt_gateway_open_answer_tokens_left", "Answer tokens the open requests may still "
                                "produce: their max_tokens less what they have",
                                value=counters.pop("open_answer_tokens_left", 0))
        yield GaugeMetricFamily("pdrt_gateway_open_drafts", "Prompts being typed at the gateway",
                                value=counters.pop("open_drafts", 0))
        yield GaugeMetricFamily("pdrt_gateway_warmup_reservations", "Sessions whose warmup holds a prefill",
                                value=counters.pop("warmup_reservations", 0))
        events = CounterMetricFamily("pdrt_gateway_events", "The gateway's counters (Status.counters): drafts, "
                                     "warmups, dropped datagrams and messages by reason", labels=["event"])
        for name, value in sorted(counters.items()):
            events.add_metric([name], value)
        yield events
