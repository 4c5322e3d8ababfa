"""KV transfer backends over real shared memory and real loopback sockets."""

import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch
import zmq

from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.errors import TransferError
from pdrt.transport import KVPuller, KVSource, TransferBackend, make_puller, make_source
from pdrt.transport.copy import coalesce
from pdrt.transport.shm import SHM_DIR, remove_segments, segment_path
from pdrt.wire import KVSourceDescriptor, kv_pull_reply_decoder

SHAPE = (3, 2, 24, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
BACKENDS = [TransferBackend.SHM, TransferBackend.TCP]
LONG_LEASE_S = 60.0


def lease(seconds: float = LONG_LEASE_S) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def run_id() -> str:
    return f"pdrt-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def new_source(run_id: str) -> Iterator[Callable[..., tuple[KVSource, torch.Tensor]]]:
    """Sources with random pool contents, all closed at the end of the test."""
    started: list[KVSource] = []

    def make(backend: TransferBackend, shape: tuple[int, ...] = SHAPE,
             dtype: torch.dtype = torch.float32) -> tuple[KVSource, torch.Tensor]:
        source = make_source(backend, f"{run_id}-prefill-{len(started)}", "127.0.0.1")
        started.append(source)
        pool = source.allocate(shape, dtype)
        pool.copy_(torch.randn(shape).to(dtype))
        return source, pool

    yield make
    for source in started:
        source.close()


@pytest.fixture
def new_puller() -> Iterator[Callable[..., tuple[KVPuller, torch.Tensor]]]:
    started: list[KVPuller] = []

    def make(shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32) -> tuple[KVPuller, torch.Tensor]:
        pool = torch.randn(shape).to(dtype)
        puller = make_puller(pool)
        started.append(puller)
        return puller, pool

    yield make
    for puller in started:
        puller.close()


def assert_pulled(dst: torch.Tensor, before: torch.Tensor, src: torch.Tensor, src_ids: list[int],
                  dst_ids: list[int]) -> None:
    """`dst` holds `src`'s blocks at `dst_ids` and is otherwise what it was."""
    expected = before.clone()
    expected[:, :, dst_ids] = src[:, :, src_ids]
    assert torch.equal(dst, expected)


# -- both backends ----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name.lower())
def test_pull_copies_the_requested_blocks_and_leaves_the_others_untouched(backend, new_source, new_puller):
    source, src = new_source(backend)
    puller, dst = new_puller()
    before = dst.clone()
    src_ids = [2, 3, 4, 9, 17, 18, 0, 23]
    dst_ids = [10, 11, 12, 1, 5, 6, 20, 7]
    source.export("req-1", src_ids, lease())
    puller.pull(source.descriptor, "req-1", src_ids, dst_ids, lease(), timeout_s=5)
    assert_pulled(dst, before, src, src_ids, dst_ids)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name.lower())
def test_pull_of_bfloat16_blocks_is_exact(backend, new_source, new_puller):
    source, src = new_source(backend, dtype=torch.bfloat16)
    puller, dst = new_puller(dtype=torch.bfloat16)
    before = dst.clone()
    source.export("req-1", [5, 1], lease())
    puller.pull(source.descriptor, "req-1", [5, 1], [0, 23], lease(), timeout_s=5)
    assert_pulled(dst, before, src, [5, 1], [0, 23])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name.lower())
@pytest.mark.parametrize("shape, dtype", [((3, 2, 24, 4, 2, 16), torch.float32),
                                          ((3, 2, 24, 8, 2, 8), torch.float32),
                                          ((2, 2, 24, 4, 2, 8), torch.float32),
                                          (SHAPE, torch.bfloat16)], ids=["head_dim", "block_size", "layers", "dtype"])
def test_pull_into_a_pool_of_another_layout_raises(backend, shape, dtype, new_source, new_puller):
    source, _ = new_source(backend)
    puller, _ = new_puller(shape, dtype)
    source.export("req-1", [1], lease())
    with pytest.raises(TransferError, match="layout"):
        puller.pull(source.descriptor, "req-1", [1], [1], lease(), timeout_s=5)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name.lower())
@pytest.mark.parametrize("src_ids, dst_ids", [([24], [0]), ([0], [24]), ([-1], [0]), ([0, 1], [0]), ([0, 1], [3, 3])])
def test_pull_of_bad_block_ids_raises(backend, src_ids, dst_ids, new_source, new_puller):
    source, _ = new_source(backend)
    puller, _ = new_puller()
    source.export("req-1", list(range(24)), lease())
    with pytest.raises(TransferError):
        puller.pull(source.descriptor, "req-1", src_ids, dst_ids, lease(), timeout_s=5)


def test_one_puller_takes_shm_and_tcp_sources_in_turn(new_source, new_puller):
    shm, shm_pool = new_source(TransferBackend.SHM)
    tcp, tcp_pool = new_source(TransferBackend.TCP)
    puller, dst = new_puller()
    before = dst.clone()
    shm.export("a", [0, 1], lease())
    tcp.export("b", [7, 8], lease())
    puller.pull(shm.descriptor, "a", [0, 1], [2, 3], lease(), timeout_s=5)
    puller.pull(tcp.descriptor, "b", [7, 8], [4, 5], lease(), timeout_s=5)
    expected = before.clone()
    expected[:, :, [2, 3]] = shm_pool[:, :, [0, 1]]
    expected[:, :, [4, 5]] = tcp_pool[:, :, [7, 8]]
    assert torch.equal(dst, expected)


def test_a_descriptor_of_an_unknown_backend_raises(new_puller):
    puller, _ = new_puller()
    descriptor = KVSourceDescriptor(99, "nowhere", *SHAPE[:1], SHAPE[2], SHAPE[3], SHAPE[4], SHAPE[5], "float32")
    with pytest.raises(TransferError, match="backend"):
        puller.pull(descriptor, "req-1", [0], [0], lease(), timeout_s=1)


def test_coalesce_groups_pairs_consecutive_on_both_sides():
    assert coalesce([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 7, 8]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert coalesce([], []) == []


# -- a source in another process --------------------------------------------

SOURCE_PROCESS = textwrap.dedent("""
    import sys, time
    import msgspec, torch
    from pdrt.transport import TransferBackend, make_source

    shape, run_id = tuple(map(int, sys.argv[1].split(","))), sys.argv[2]
    sources = []
    for backend in (TransferBackend.SHM, TransferBackend.TCP):
        source = make_source(backend, f"{run_id}-prefill-{backend.name.lower()}", "127.0.0.1")
        pool = source.allocate(shape, torch.float32)
        pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(shape) * int(backend))
        source.export("req-1", list(range(shape[2])), time.monotonic() + 60)
        sources.append(source)
        print(msgspec.json.encode(source.descriptor).decode(), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    for source in sources:
        source.close()
""")


@pytest.fixture(scope="module")
def other_process_sources() -> Iterator[dict[TransferBackend, KVSourceDescriptor]]:
    run_id = f"pdrt-test-{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen([sys.executable, "-c", SOURCE_PROCESS, ",".join(map(str, SHAPE)), run_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        descriptors = [msgspec.json.decode(proc.stdout.readline(), type=KVSourceDescriptor) for _ in BACKENDS]
        yield {TransferBackend(d.backend): d for d in descriptors}
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        remove_segments(run_id)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name.lower())
def test_a_pull_from_a_source_in_another_process_copies_its_blocks_exactly(backend, other_process_sources,
                                                                          new_puller):
    descriptor = other_process_sources[backend]
    puller, dst = new_puller()
    before = dst.clone()
    src = torch.arange(dst.numel(), dtype=torch.float32).view(SHAPE) * int(backend)
    src_ids, dst_ids = [20, 21, 22, 3, 8], [0, 1, 2, 15, 16]
    puller.pull(descriptor, "req-1", src_ids, dst_ids, lease(), timeout_s=5)
    assert_pulled(dst, before, src, src_ids, dst_ids)


# -- shared memory ------------------------------------------------------------


def test_shm_pull_that_ends_after_the_lease_raises(new_source, new_puller):
    source, _ = new_source(TransferBackend.SHM)
    puller, _ = new_puller()
    source.export("req-1", [1], lease())
    with pytest.raises(TransferError, match="lease"):
        puller.pull(source.descriptor, "req-1", [1], [1], time.monotonic() - 0.001, timeout_s=5)


def test_shm_source_puts_its_pool_in_a_segment_named_after_it(run_id):
    source = make_source(TransferBackend.SHM, f"{run_id}-prefill-0", "")
    pool = source.allocate(SHAPE, torch.float16)
    path = SHM_DIR / f"{run_id}-prefill-0"
    assert source.descriptor.address == str(path)
    assert path.stat().st_size == pool.numel() * 2
    source.close()


def test_shm_close_unlinks_the_segment_and_may_be_called_twice(new_source):
    source, _ = new_source(TransferBackend.SHM)
    path = SHM_DIR / source.descriptor.address.rsplit("/", 1)[1]
    assert path.exists()
    source.close()
    assert not path.exists()
    source.close()


def test_shm_puller_keeps_pulling_from_a_segment_unlinked_after_it_was_mapped(new_source, new_puller):
    source, src = new_source(TransferBackend.SHM)
    puller, dst = new_puller()
    puller.pull(source.descriptor, "req-1", [0], [0], lease(), timeout_s=5)
    expected = src.clone()
    segment_path(source.descriptor.address.rsplit("/", 1)[1]).unlink()  # as the supervisor does for a dead worker
    puller.pull(source.descriptor, "req-1", [4, 5], [4, 5], lease(), timeout_s=5)
    assert torch.equal(dst[:, :, 4:6], expected[:, :, 4:6])


def test_shm_pull_from_a_segment_that_does_not_exist_raises(new_source, new_puller):
    source, _ = new_source(TransferBackend.SHM)
    descriptor = source.descriptor
    source.close()
    puller, _ = new_puller()
    with pytest.raises(TransferError, match="does not exist"):
        puller.pull(descriptor, "req-1", [0], [0], lease(), timeout_s=5)


def test_shm_pull_of_a_segment_whose_size_differs_from_its_descriptor_raises(new_source, new_puller):
    source, _ = new_source(TransferBackend.SHM)
    puller, _ = new_puller()
    lying = msgspec.structs.replace(source.descriptor, num_blocks=SHAPE[2] + 1)
    with pytest.raises(TransferError, match="bytes"):
        puller.pull(lying, "req-1", [0], [0], lease(), timeout_s=5)


def test_shm_pull_of_a_path_outside_dev_shm_raises(new_source, new_puller):
    source, _ = new_source(TransferBackend.SHM)
    puller, _ = new_puller()
    with pytest.raises(TransferError, match="segment"):
        puller.pull(msgspec.structs.replace(source.descriptor, address="/etc/passwd"), "r", [0], [0], lease(), 5)


@pytest.mark.parametrize("name", ["", "../etc/passwd", "a/b", ".hidden", "x" * 300, "sp ace"])
def test_unsafe_segment_names_are_rejected(name):
    with pytest.raises(TransferError, match="unsafe"):
        make_source(TransferBackend.SHM, name, "")
    with pytest.raises(TransferError, match="unsafe"):
        remove_segments(name)


def test_remove_segments_unlinks_every_segment_with_the_prefix_and_no_other(run_id):
    for name in ("prefill-0-a", "prefill-0-b", "decode-0-a"):
        (SHM_DIR / f"{run_id}-{name}").write_bytes(b"kv")
    try:
        assert remove_segments(f"{run_id}-prefill-0-") == 2
        assert sorted(p.name for p in SHM_DIR.glob(f"{run_id}*")) == [f"{run_id}-decode-0-a"]
    finally:
        remove_segments(run_id)


# -- TCP ----------------------------------------------------------------------


def test_tcp_pull_of_a_withdrawn_export_raises(new_source, new_puller):
    source, _ = new_source(TransferBackend.TCP)
    puller, _ = new_puller()
    source.export("req-1", [1, 2], lease())
    source.withdraw("req-1")
    source.withdraw("never-exported")
    with pytest.raises(TransferError, match="no export"):
        puller.pull(source.descriptor, "req-1", [1, 2], [1, 2], lease(), timeout_s=5)


def test_tcp_pull_of_an_expired_export_raises(new_source, new_puller):
    source, _ = new_source(TransferBackend.TCP)
    puller, _ = new_puller()
    source.export("req-1", [1, 2], time.monotonic() - 0.001)
    with pytest.raises(TransferError, match="expired"):
        puller.pull(source.descriptor, "req-1", [1, 2], [1, 2], lease(), timeout_s=5)


def test_tcp_pull_of_blocks_outside_the_export_raises(new_source, new_puller):
    source, _ = new_source(TransferBackend.TCP)
    puller, _ = new_puller()
    source.export("req-1", [1, 2], lease())
    with pytest.raises(TransferError, match="not exported"):
        puller.pull(source.descriptor, "req-1", [1, 3], [1, 2], lease(), timeout_s=5)


def test_tcp_pull_from_a_closed_source_raises_within_its_timeout(new_source, new_puller):
    source, _ = new_source(TransferBackend.TCP)
    puller, _ = new_puller()
    source.export("req-1", [1], lease())
    source.close()
    start = time.monotonic()
    with pytest.raises(TransferError, match="no answer"):
        puller.pull(source.descriptor, "req-1", [1], [1], lease(), timeout_s=0.3)
    assert time.monotonic() - start < 0.8


def test_tcp_pull_after_a_timed_out_pull_gets_its_own_blocks(new_source, new_puller):
    source, src = new_source(TransferBackend.TCP)
    puller, dst = new_puller()
    before = dst.clone()
    source.export("req-1", list(range(24)), lease())
    with pytest.raises(TransferError, match="no answer"):
        puller.pull(source.descriptor, "req-1", list(range(12)), list(range(12)), lease(), timeout_s=0)
    time.sleep(0.05)  # the late reply to the first request arrives meanwhile
    puller.pull(source.descriptor, "req-1", [20], [20], lease(), timeout_s=5)
    assert_pulled(dst, before, src, [20], [20])


def test_tcp_source_close_stops_its_server_within_a_second(new_source):
    source, _ = new_source(TransferBackend.TCP)
    start = time.monotonic()
    source.close()
    assert time.monotonic() - start < 1.0
    source.close()


def test_tcp_source_answers_an_undecodable_request_with_an_error_and_keeps_serving(new_source, new_puller):
    source, src = new_source(TransferBackend.TCP)
    ctx = zmq.Context()
    sock = make_socket(ctx, SocketSpec(zmq.DEALER, source.descriptor.address, bind=False))
    try:
        sock.send(b"\xc1 not msgpack")
        assert sock.poll(5000)
        reply = kv_pull_reply_decoder.decode(sock.recv())
        assert reply.error == "bad_request"
    finally:
        sock.close()
        ctx.term()
    puller, dst = new_puller()
    source.export("req-1", [3], lease())
    puller.pull(source.descriptor, "req-1", [3], [4], lease(), timeout_s=5)
    assert torch.equal(dst[:, :, 4], src[:, :, 3])
