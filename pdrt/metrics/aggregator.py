"""The controller's view of the whole node's metrics: every process's latest report, merged, plus KE and ETOP.

Each process reports its metrics, unlabelled, every second (`MetricsReport`).
A report is parsed once, on arrival, and its samples labelled with the
sender's `process` and `role`; a report from an incarnation the registry does
not know is ignored, and a process that leaves the registry leaves the view.
`refresh` (every controller tick) merges the reports with the controller's own
metrics into `snapshot`: a list that is replaced whole and never mutated, so
the HTTP thread may read it while the controller goes on.

The indices that need more than one process are computed here from the
reported counters: KE from the decode workers' pulls and the prefill workers'
expired handoffs, ETOP from the gateways' SLO-meeting output tokens and the
workers' uptimes.
"""

from dataclasses import dataclass

import structlog
from prometheus_client import Counter, Gauge
from prometheus_client.metrics_core import Metric

from pdrt.control_plane.registry import Registry
from pdrt.metrics.exposition import merge, parse, relabel, render, samples, total
from pdrt.metrics.health import effective_output_tokens_per_worker_hour, handoff_efficiency
from pdrt.metrics.process_metrics import new_registry
from pdrt.node_config import WORKER_ROLES
from pdrt.wire import MetricsReport

log = structlog.get_logger(__name__)

ROLES = ("gateway", *WORKER_ROLES)


@dataclass(slots=True)
class _Report:
    incarnation: str
    families: list[Metric]


class MetricsAggregator:
    def __init__(self, processes: Registry) -> None:
        self.processes = processes
        self.reports: dict[str, _Report] = {}  # process id -> its latest report, labelled
        self.registry = r = new_registry()
        self.labels = {"process": "controller", "role": "controller"}
        self.num_reports = Counter("pdrt_controller_metrics_reports", "Metrics reports merged", registry=r)
        self.live = Gauge("pdrt_controller_processes", "Live processes in the registry, by role", ["role"],
                          registry=r)
        self.ke = Gauge("pdrt_health_ke", "KV handoff efficiency: successful transfers / completed prefills "
                        "(target > 0.999)", registry=r)
        self.etop = Gauge("pdrt_health_etop", "Effective output tokens (of requests that met their SLOs) per "
                          "worker-hour", registry=r)
        self.snapshot: list[Metric] = []

    def report(self, message: MetricsReport) -> None:
        entry = self.processes.entries.get(message.process_id)
        if entry is None or entry.incarnation != message.incarnation:
            return  # not registered (yet, or any more)
        try:
            families = parse(message.exposition)
        except ValueError as exc:
            log.warning("controller dropped metrics it could not parse", process=message.process_id, error=str(exc))
            return
        labels = {"process": message.process_id, "role": message.role}
        self.reports[message.process_id] = _Report(message.incarnation, relabel(families, labels))
        self.num_reports.inc()

    def refresh(self) -> list[Metric]:
        live = self.processes.entries
        self.reports = {pid: report for pid, report in self.reports.items()
                        if pid in live and live[pid].incarnation == report.incarnation}
        for role in ROLES:
            self.live.labels(role).set(sum(e.role == role for e in live.values()))
        reported = [f for report in self.reports.values() for f in report.families]
        self.ke.set(handoff_efficiency(total(reported, "pdrt_kv_pulls_total", result="succeeded"),
                                       total(reported, "pdrt_kv_pulls_total", result="failed"),
                                       total(reported, "pdrt_kv_handoffs_total", result="expired")))
        worker_seconds = sum(value for labels, value in samples(reported, "pdrt_process_uptime_seconds")
                             if labels.get("role") in WORKER_ROLES)
        self.etop.set(effective_output_tokens_per_worker_hour(
            total(reported, "pdrt_gateway_slo_output_tokens_total"), worker_seconds))
        self.snapshot = merge([relabel(self.registry.collect(), self.labels), reported])
        return self.snapshot

    def exposition(self) -> bytes:
        return render(self.snapshot)
