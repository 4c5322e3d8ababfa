"""A node that cannot start fails fast: a port in use, a KV pool that holds no block, shared memory too small for
the pool, a draft model of another vocabulary. `pdrt up` exits non-zero within seconds, its last line naming the
cause (the port, the path, the size); nothing is restarted over and over."""

import socket
import time

import pytest

from pdrt.errors import UnavailableError
from pdrt.supervisor import preflight
from pdrt.testing.node import Node, free_port

FAIL_FAST_S = 10.0  # what pdrt up sees before it starts a process (preflight.py)
# What only a process finds, once it has loaded its model: on a 2-core host four processes take about 8 s to get
# there; crashing and restarting took 68 s to give up, and named no cause.
LOADED_FAIL_FAST_S = 20.0


def failure_of(node: Node) -> tuple[str, float]:
    """The last line `pdrt up` printed when it gave up, and how long after starting it did."""
    started = time.monotonic()
    with pytest.raises(UnavailableError) as failed:
        node.start()
    return failed.value.args[0].strip().splitlines()[-1], time.monotonic() - started


@pytest.mark.parametrize("table", ["gateway", "controller"])
def test_a_port_in_use_stops_the_node_at_once_naming_the_port(model_dirs, tmp_path, table):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        last, seconds = failure_of(Node(tmp_path, str(model_dirs["llama"]), extra={table: {"port": port}}))
    assert "cannot start" in last and f"127.0.0.1:{port} ([{table}] port)" in last and "in use" in last, last
    assert seconds < FAIL_FAST_S


def test_an_http_port_in_use_stops_the_node_at_once_naming_the_port(model_dirs, tmp_path):
    with socket.socket() as taken:
        port = free_port()
        taken.bind(("127.0.0.1", port))
        taken.listen()
        last, seconds = failure_of(Node(tmp_path, str(model_dirs["llama"]), extra={"gateway": {"http_port": port}}))
    assert "cannot start" in last and f"127.0.0.1:{port} ([gateway] http_port)" in last, last
    assert seconds < FAIL_FAST_S


def test_a_pool_that_holds_no_block_stops_the_node_naming_the_size(model_dirs, tmp_path):
    last, seconds = failure_of(Node(tmp_path, str(model_dirs["llama"]), engine={"kv_cache_bytes": 1000}))
    assert "cannot start" in last and "1000 bytes holds no block" in last, last
    assert seconds < FAIL_FAST_S


def test_a_pool_that_holds_no_block_in_the_models_dtype_stops_the_node_once_loaded(model_dirs, tmp_path):
    # Room for a block of 16-bit KV, not of the float32 KV the workers keep on this CPU: only they can tell.
    block16 = preflight.smallest_block_bytes(str(model_dirs["llama"]), 16)
    last, seconds = failure_of(Node(tmp_path, str(model_dirs["llama"]), engine={"kv_cache_bytes": block16}))
    assert "cannot start" in last and f"{block16} bytes holds no block" in last, last
    assert seconds < LOADED_FAIL_FAST_S


def test_shared_memory_too_small_for_the_pool_stops_the_node_naming_the_path_and_size(model_dirs, tmp_path):
    pool = 1 << 44  # far more than any host's /dev/shm
    last, seconds = failure_of(Node(tmp_path, str(model_dirs["llama"]), engine={"kv_cache_bytes": pool}))
    assert "cannot start" in last and "/dev/shm" in last and f"pools of {pool} bytes" in last, last
    assert seconds < FAIL_FAST_S


def test_a_draft_model_of_another_vocabulary_stops_the_node_at_once_naming_both(model_dirs, tmp_path):
    from pdrt.testing.tiny_model import build_tiny_model

    draft = build_tiny_model(tmp_path / "v512", vocab_size=512)
    last, seconds = failure_of(Node(tmp_path, str(model_dirs["llama"]), engine={"speculate": str(draft)}))
    assert "cannot start" in last and "vocabulary (512 tokens) is not the target's" in last, last
    assert seconds < FAIL_FAST_S
