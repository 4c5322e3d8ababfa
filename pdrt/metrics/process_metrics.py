"""The registry of this process: the one its role's metrics live in, reported to the controller by its link.

A process runs one role, so it has one registry. The role that builds its
metrics installs the registry here, and `ControllerLink` reports whatever is
installed: the link is created before the role's metrics exist (the gateway
builds its link first), and this keeps the two apart without threading a
callback through every constructor. Building a newer role object in the same
process (tests do) simply installs its registry instead.
"""

import time

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics, generate_latest

# `_created` series would double every counter and histogram for a timestamp nobody here reads.
disable_created_metrics()

_installed: CollectorRegistry | None = None
_STARTED = time.monotonic()  # imported with the controller link, before any model loads: the process's start


def new_registry() -> CollectorRegistry:
    """A registry with what every process reports: its uptime (the controller's ETOP divides by it)."""
    registry = CollectorRegistry()
    uptime = Gauge("pdrt_process_uptime_seconds", "Seconds since this process started", registry=registry)
    uptime.set_function(lambda: time.monotonic() - _STARTED)
    return registry


def install(registry: CollectorRegistry) -> None:
    global _installed
    _installed = registry


def process_exposition() -> bytes | None:
    """This process's metrics as Prometheus text; None before a role installed its registry."""
    return None if _installed is None else generate_latest(_installed)
