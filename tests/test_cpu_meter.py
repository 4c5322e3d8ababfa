"""CpuMeter against real processes: a child that spins and one that sleeps, under a root of this test."""

import os
import subprocess
import sys
import time

import pytest

from pdrt.bench.cpu_meter import CpuMeter, CpuUsage

pytestmark = pytest.mark.skipif(not CpuMeter.available(), reason="needs /proc")

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"


def test_names_each_process_of_the_tree_and_counts_what_it_used() -> None:
    # A shell root whose children are the spinner and the sleeper, as `pdrt up` is the root of its workers.
    root = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{SPIN}" spin & sleep 30 & wait'])
    try:
        time.sleep(0.5)  # both children started
        meter = CpuMeter({root.pid: "root", os.getpid(): "client"})
        meter.start()
        time.sleep(1.0)
        usage = meter.read()
    finally:
        subprocess.run(["pkill", "-P", str(root.pid)], check=False)
        root.kill()
        root.wait()
    assert usage is not None and usage.cores == os.cpu_count()
    names = set(usage.processes)
    assert {"root", "client", "sleep", "root child"} <= names  # `python -c` has no name: it goes by its root's
    spinner = usage.processes["root child"]
    assert spinner > 0.3  # a core's worth, less what a shared machine takes from it
    assert usage.processes["sleep"] < 0.05
    assert usage.busy >= spinner - 0.05
    assert "cores busy" in usage.describe() and usage.as_dict()["cores"] == usage.cores


def test_read_before_start_is_none() -> None:
    assert CpuMeter({os.getpid(): "client"}).read() is None


def test_spans_pool_weighted_by_their_length_and_a_process_missing_from_one_counts_zero_there() -> None:
    short = CpuUsage(2, 1.0, 2.0, 0.0, {"decode-0": 1.0, "prefill-0": 1.0})
    long = CpuUsage(2, 3.0, 1.0, 0.4, {"decode-0": 1.0})
    pooled = CpuUsage.pooled([short, long])
    assert pooled is not None and (pooled.cores, pooled.seconds) == (2, 4.0)
    assert (pooled.busy, pooled.stolen) == pytest.approx((1.25, 0.3))
    assert pooled.processes == {"decode-0": 1.0, "prefill-0": 0.25}
    assert CpuUsage.pooled([]) is None
