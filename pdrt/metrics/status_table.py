"""`pdrt status`: a table of the node, once or refreshed like `top`.

Two sources, both read-only: the gateway's `Status` (workers as it routes
to them: alive, queues, KV blocks, drafts) over the native protocol, and the
merged Prometheus metrics (SLO attainment, TTFT/TPOT percentiles, prefix hit
rates, the health indices) from the controller's metrics port — or any URL
that serves the same text, such as the gateway's HTTP `/metrics`. Either may
be missing; the table says so and shows the rest.

Imports of the client and of prometheus_client wait until the command runs,
so that building the `pdrt` parser stays cheap.
"""

import argparse
import math
import time
import urllib.request
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pdrt.text_table import aligned

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from pdrt.wire import Status

DEFAULT_METRICS_PORT = 7103  # [controller] metrics_port (pdrt/node_config.py)
CLEAR = "\x1b[H\x1b[2J"
PREFILLING_ROLES = ("prefill", "colocated")
DECODING_ROLES = ("decode", "colocated")


def add_status_parser(sub: "argparse._SubParsersAction") -> None:
    status = sub.add_parser("status", help="a live table: workers, SLO attainment, TTFT/TPOT, health indices")
    status.add_argument("--server", metavar="ADDRESS", help="the gateway (default: $PDRT_SERVER, else "
                                                            "tcp://$PDRT_HOST:$PDRT_PORT, as for `pdrt up`)")
    status.add_argument("--metrics", metavar="URL", help="Prometheus text of the node (default: the controller's "
                                                         f"metrics port, http://<server host>:{DEFAULT_METRICS_PORT}"
                                                         "/metrics)")
    status.add_argument("--watch", type=float, metavar="S", help="refresh every S seconds until Ctrl-C")
    status.add_argument("--timeout", type=float, default=5.0, metavar="S", help="per source (default 5)")
    status.set_defaults(func=cmd_status)


def default_metrics_url(server: str) -> str:
    host = urlsplit(server.replace("tcp://", "http://", 1)).hostname or "127.0.0.1"
    return f"http://{host}:{DEFAULT_METRICS_PORT}/metrics"


def cmd_status(args: argparse.Namespace) -> int:
    from pdrt.client import Client
    from pdrt.client.server_address import default_server
    from pdrt.errors import PdrtError

    server = args.server or default_server()
    metrics_url = args.metrics or default_metrics_url(server)
    client: Client | None = None
    try:
        while True:
            notes: list[str] = []
            status = None
            try:
                client = client or Client(server, timeout_s=args.timeout)
                status = client.status()
            except PdrtError as exc:
                if client is not None:
                    client.close()
                client = None
                if args.watch is None:
                    raise
                notes.append(f"gateway {server}: {exc.code}: {exc}")
            families = fetch_metrics(metrics_url, args.timeout, notes)
            table = render_table(status, families, notes)
            if args.watch is None:
                print(table)
                return 0
            print(f"{CLEAR}pdrt status  {server}  {time.strftime('%H:%M:%S')}  (every {args.watch:g} s, Ctrl-C "
                  f"quits)\n{table}", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        if client is not None:
            client.close()


def fetch_metrics(url: str, timeout_s: float, notes: list[str]) -> "list[Metric] | None":
    """The families at `url`; None (and a note saying why) when they cannot be read."""
    from pdrt.metrics.exposition import parse

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return parse(reply.read())
    except (OSError, ValueError) as exc:
        notes.append(f"metrics {url}: {exc}")
        return None


# -- rendering ------------------------------------------------------------------------


def _number(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.{digits}f}"


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _per_process(families: "list[Metric]", sample_name: str) -> dict[str, float]:
    from pdrt.metrics.exposition import samples

    return {labels.get("process", ""): value for labels, value in samples(families, sample_name)}


def worker_rows(status: "Status", families: "list[Metric] | None") -> list[str]:
    hit_rate = _per_process(families or [], "pdrt_worker_prefix_cache_hit_rate")
    psi = _per_process(families or [], "pdrt_health_psi")
    ds = _per_process(families or [], "pdrt_health_ds")
    rows = [["process", "role", "alive", "running", "waiting", "kv used", "drafts", "prefix hit", "psi", "ds"]]
    for w in status.workers:
        load = w.load
        kv = f"{100 * load.num_used_blocks / load.num_blocks:.1f}%" if load.num_blocks else "-"
        hits = hit_rate.get(w.process_id, math.nan)
        rows.append([w.process_id, w.role, "yes" if w.alive else "NO", str(load.num_running), str(load.num_waiting),
                     kv, str(load.num_drafts), "-" if math.isnan(hits) else f"{100 * hits:.0f}%",
                     _number(psi.get(w.process_id, math.nan), 1), _number(ds.get(w.process_id, math.nan), 3)])
    return aligned(rows)


def summary_lines(families: "list[Metric]") -> list[str]:
    from pdrt.metrics.exposition import histogram_quantile, samples, total
    from pdrt.metrics.health import DS_TARGET, KE_TARGET, PSI_TARGET

    outcomes: dict[str, float] = {}
    for labels, value in samples(families, "pdrt_gateway_requests_total"):
        outcomes[labels.get("outcome", "?")] = outcomes.get(labels.get("outcome", "?"), 0.0) + value
    ended = sum(outcomes.values())
    lines = [f"requests: {ended:.0f} ended, {total(families, 'pdrt_gateway_open_requests'):.0f} open"
             + (" | " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(outcomes.items())) if outcomes else "")]
    judged, met = total(families, "pdrt_gateway_slo_requests_total"), total(families, "pdrt_gateway_slo_met_total",
                                                                             slo="both")
    ttft_slo = next((v for _, v in samples(families, "pdrt_gateway_ttft_slo_seconds")), math.nan)
    tpot_slo = next((v for _, v in samples(families, "pdrt_gateway_tpot_slo_seconds")), math.nan)
    attainment = f"{100 * met / judged:.1f}% of {judged:.0f}" if judged else "- (no request judged yet)"
    lines.append(f"SLO attainment: {attainment} (TTFT <= {_seconds(ttft_slo)}, TPOT <= {_seconds(tpot_slo)})")
    q = {(name, p): histogram_quantile(p, families, f"pdrt_gateway_{name}_seconds")
         for name in ("ttft", "tpot") for p in (0.5, 0.9)}
    lines.append(f"TTFT p50 {_seconds(q['ttft', 0.5])}  p90 {_seconds(q['ttft', 0.9])}    "
                 f"TPOT p50 {_seconds(q['tpot', 0.5])}  p90 {_seconds(q['tpot', 0.9])}")
    psi = [v for _, v in samples(families, "pdrt_health_psi") if not math.isnan(v)]
    ds = [v for _, v in samples(families, "pdrt_health_ds") if not math.isnan(v)]
    ke = next((v for _, v in samples(families, "pdrt_health_ke")), math.nan)
    etop = next((v for _, v in samples(families, "pdrt_health_etop")), math.nan)
    lines.append(f"health: PSI {_number(min(psi) if psi else math.nan, 1)} (> {PSI_TARGET:g})  "
                 f"DS {_number(max(ds) if ds else math.nan, 3)} (< {DS_TARGET:g})  "
                 f"KE {_number(ke, 4)} (> {KE_TARGET:g})  ETOP {_number(etop, 0)} tokens/worker-hour")
    for labels, _ in samples(families, "pdrt_controller_role_change_last_info"):
        if "to_role" in labels:  # an Info metric before its first value has no labels of its own
            lines.append(f"last role change: {labels.get('worker')} {labels.get('from_role')} -> "
                         f"{labels.get('to_role')} in {labels.get('seconds')} s ({labels.get('reason')})")
    for labels, _ in samples(families, "pdrt_controller_balancer_last_info"):
        if "action" in labels:
            lines.append(f"balancer at {labels.get('at')}: {labels.get('action')}: {labels.get('reason')}")
    return lines


def render_table(status: "Status | None", families: "list[Metric] | None", notes: list[str]) -> str:
    """The whole table: workers, then the node's figures (PSI the worst worker's, DS too), then what is missing."""
    lines: list[str] = []
    if status is not None:
        lines += worker_rows(status, families) if status.workers else ["no live worker"]
        lines.append("")
    if families is not None:
        lines += summary_lines(families)
    lines += [f"unavailable: {note}" for note in notes]
    return "\n".join(lines)

