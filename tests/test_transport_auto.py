"""The auto KV backend: one pool in shared memory and on TCP, each puller taking the path its host can use.

Real segments, real loopback sockets, and a source in another process. The
"other host" is played by giving the puller (or the source) another host
identity; each test breaks the path that must not be taken (a segment that
does not exist, an endpoint nobody serves), so a pull that succeeds proves
which path it took.
"""

import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from pdrt.errors import ConfigError, TransferError
from pdrt.transport import TransferBackend, make_puller
from pdrt.transport.auto import AutoPuller, AutoSource, local_host_id
from pdrt.transport.shm import SHM_DIR, remove_segments
from pdrt.wire import KVSourceDescriptor

SHAPE = (2, 2, 16, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
NOBODY = "tcp://127.0.0.1:9"  # the discard port: nothing of ours serves there
NO_SEGMENT = "/dev/shm/pdrt-test-no-such-segment"


def lease(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def run_id() -> Iterator[str]:
    run_id = f"pdrt-test-{uuid.uuid4().hex[:10]}"
    yield run_id
    remove_segments(run_id)


@pytest.fixture
def new_source(run_id: str) -> Iterator[Callable[..., tuple[AutoSource, torch.Tensor]]]:
    started: list[AutoSource] = []

    def make(host_id: str | None = None) -> tuple[AutoSource, torch.Tensor]:
        source = AutoSource(f"{run_id}-prefill-{len(started)}", "127.0.0.1", host_id=host_id)
        started.append(source)
        pool = source.allocate(SHAPE, torch.float32)
        pool.copy_(torch.randn(SHAPE))
        return source, pool

    yield make
    for source in started:
        source.close()


@pytest.fixture
def new_puller() -> Iterator[Callable[..., tuple[AutoPuller, torch.Tensor]]]:
    started: list[AutoPuller] = []

    def make(host_id: str | None = None) -> tuple[AutoPuller, torch.Tensor]:
        pool = torch.randn(SHAPE)
        started.append(AutoPuller(pool, host_id=host_id))
        return started[-1], pool

    yield make
    for puller in started:
        puller.close()


SOURCE_PROCESS = textwrap.dedent("""
    import sys, time
    import msgspec, torch
    from pdrt.transport import TransferBackend, make_source

    shape = tuple(int(n) for n in sys.argv[1].split(","))
    source = make_source(TransferBackend.AUTO, sys.argv[2] + "-prefill-0", "127.0.0.1")
    pool = source.allocate(shape, torch.float32)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(shape))
    source.export("req-1", list(range(shape[2])), time.monotonic() + 60)
    print(msgspec.json.encode(source.descriptor).decode(), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    source.close()
""")


@pytest.fixture(scope="module")
def other_process_source() -> Iterator[KVSourceDescriptor]:
    """An auto source in another process of this host, its pool filled with 0, 1, 2, ..."""
    run_id = f"pdrt-test-{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen([sys.executable, "-c", SOURCE_PROCESS, ",".join(map(str, SHAPE)), run_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield msgspec.json.decode(proc.stdout.readline(), type=KVSourceDescriptor)
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        remove_segments(run_id)


def other_process_pool() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)


def assert_pulled(dst: torch.Tensor, before: torch.Tensor, src: torch.Tensor, src_ids: list[int],
                  dst_ids: list[int]) -> None:
    expected = before.clone()
    expected[:, :, dst_ids] = src[:, :, src_ids]
    assert torch.equal(dst, expected)


# -- the descriptor -------------------------------------------------------------


def test_descriptor_gives_the_segment_the_tcp_endpoint_and_the_host_of_the_segment(new_source, run_id):
    source, _ = new_source()
    d = source.descriptor
    assert d.backend == TransferBackend.AUTO
    assert d.address == str(SHM_DIR / f"{run_id}-prefill-0")
    assert d.tcp_address.startswith("tcp://127.0.0.1:")
    assert d.host_id == local_host_id() != ""


def test_two_processes_of_this_host_agree_on_its_identity(other_process_source):
    assert other_process_source.host_id == local_host_id()


def test_a_descriptor_encoded_without_the_auto_fields_decodes_with_them_empty():
    old = msgspec.msgpack.encode([1, "/dev/shm/pdrt-x", 2, 16, 4, 2, 8, "float32"])
    d = msgspec.msgpack.decode(old, type=KVSourceDescriptor)
    assert (d.backend, d.num_blocks, d.host_id, d.tcp_address) == (1, 16, "", "")


# -- which path a pull takes ---------------------------------------------------------------


def test_a_puller_on_the_sources_host_maps_the_segment_and_never_asks_tcp(other_process_source, new_puller):
    puller, dst = new_puller()
    before = dst.clone()
    source = msgspec.structs.replace(other_process_source, tcp_address=NOBODY)
    src_ids, dst_ids = [12, 13, 14, 2], [0, 1, 2, 9]
    puller.pull(source, "req-1", src_ids, dst_ids, lease(), timeout_s=0.5)
    assert_pulled(dst, before, other_process_pool(), src_ids, dst_ids)


def test_a_puller_on_another_host_pulls_over_tcp_and_never_maps_the_segment(other_process_source, new_puller):
    puller, dst = new_puller(host_id="another-host")
    before = dst.clone()
    source = msgspec.structs.replace(other_process_source, address=NO_SEGMENT)
    src_ids, dst_ids = [15, 0, 1], [3, 4, 5]
    puller.pull(source, "req-1", src_ids, dst_ids, lease(), timeout_s=5)
    assert_pulled(dst, before, other_process_pool(), src_ids, dst_ids)


def test_a_source_of_unknown_host_is_pulled_over_tcp(other_process_source, new_puller):
    puller, dst = new_puller()
    before = dst.clone()
    source = msgspec.structs.replace(other_process_source, address=NO_SEGMENT, host_id="")
    puller.pull(source, "req-1", [4, 5], [6, 7], lease(), timeout_s=5)
    assert_pulled(dst, before, other_process_pool(), [4, 5], [6, 7])


def test_the_any_backend_puller_of_a_decode_worker_takes_auto_sources(other_process_source):
    dst = torch.zeros(SHAPE)
    puller = make_puller(dst)
    try:
        puller.pull(other_process_source, "req-1", [7, 8], [0, 1], lease(), timeout_s=5)
    finally:
        puller.close()
    assert torch.equal(dst[:, :, 0:2], other_process_pool()[:, :, 7:9])


def test_a_source_elsewhere_that_serves_no_tcp_endpoint_raises(other_process_source, new_puller):
    puller, _ = new_puller(host_id="another-host")
    source = msgspec.structs.replace(other_process_source, tcp_address="")
    with pytest.raises(TransferError, match="another host"):
        puller.pull(source, "req-1", [0], [0], lease(), timeout_s=0.5)


# -- exports and leases on each path ------------------------------------------------------------


def test_the_tcp_path_refuses_a_withdrawn_export(new_source, new_puller):
    source, _ = new_source(host_id="prefill-host")
    puller, _ = new_puller(host_id="decode-host")
    source.export("req", [0, 1], lease())
    source.withdraw("req")
    with pytest.raises(TransferError, match="no export"):
        puller.pull(source.descriptor, "req", [0, 1], [0, 1], lease(), timeout_s=5)


def test_the_shared_memory_path_refuses_an_expired_lease(new_source, new_puller):
    source, _ = new_source()
    puller, _ = new_puller()
    source.export("req", [0, 1], lease(-1.0))
    with pytest.raises(TransferError, match="expired"):
        puller.pull(source.descriptor, "req", [0, 1], [0, 1], lease(-1.0), timeout_s=5)


def test_both_paths_read_what_prefill_wrote_into_the_one_pool(new_source, new_puller):
    source, src = new_source()
    near, near_dst = new_puller()
    far, far_dst = new_puller(host_id="another-host")
    src[:, :, 5].fill_(42.0)  # written after allocate, as prefill writes its KV
    source.export("req", [5], lease())
    near.pull(source.descriptor, "req", [5], [0], lease(), timeout_s=5)
    far.pull(source.descriptor, "req", [5], [0], lease(), timeout_s=5)
    assert torch.all(near_dst[:, :, 0] == 42.0) and torch.all(far_dst[:, :, 0] == 42.0)


# -- life cycle --------------------------------------------------------------------------------


def test_close_unlinks_the_segment_and_stops_serving(new_source, new_puller):
    source, _ = new_source()
    puller, _ = new_puller(host_id="another-host")
    descriptor = source.descriptor
    source.export("req", [0], lease())
    source.close()
    assert not (SHM_DIR / descriptor.address.rsplit("/", 1)[-1]).exists()
    with pytest.raises(TransferError):
        puller.pull(descriptor, "req", [0], [0], lease(), timeout_s=0.3)


def test_a_source_that_cannot_bind_its_tcp_endpoint_leaves_no_segment(run_id):
    source = AutoSource(f"{run_id}-prefill-0", "203.0.113.7")  # TEST-NET-3: no interface of ours
    with pytest.raises(ConfigError, match="cannot listen on tcp://203.0.113.7"):  # no restart mends it
        source.allocate(SHAPE, torch.float32)
    assert not any(SHM_DIR.glob(f"{run_id}*"))
