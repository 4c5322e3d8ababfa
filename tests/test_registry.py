"""The controller's registry: leases, heartbeats, incarnations."""

from pdrt.control_plane.registry import Registry
from pdrt.wire import Load


def test_a_process_that_misses_its_lease_is_lost_exactly_once():
    registry = Registry(lease_s=2.0)
    registry.register("decode-0", "a", "decode", "tcp://x:1", b"id", now=0.0)
    assert registry.heartbeat("decode-0", "a", Load(num_running=3), now=1.5)
    assert registry.expire(now=3.0) == []
    lost = registry.expire(now=3.6)
    assert [e.process_id for e in lost] == ["decode-0"]
    assert registry.expire(now=10.0) == []
    assert registry.workers() == []


def test_a_new_incarnation_replaces_the_old_one_which_counts_as_lost():
    registry = Registry(lease_s=2.0)
    assert registry.register("prefill-0", "a", "prefill", "tcp://x:1", b"a", now=0.0) is None
    replaced = registry.register("prefill-0", "b", "prefill", "tcp://x:2", b"b", now=1.0)
    assert replaced is not None and replaced.incarnation == "a"
    assert not registry.heartbeat("prefill-0", "a", Load(), now=1.1)  # the old incarnation must register again
    assert registry.heartbeat("prefill-0", "b", Load(), now=1.1)
    assert [w.address for w in registry.workers()] == ["tcp://x:2"]


def test_heartbeats_carry_load_and_gateways_are_not_workers():
    registry = Registry(lease_s=2.0)
    registry.register("gateway", "g", "gateway", "tcp://x:3", b"g", now=0.0)
    registry.register("decode-0", "d", "decode", "tcp://x:4", b"d", now=0.0)
    registry.heartbeat("decode-0", "d", Load(num_used_blocks=7), now=0.5)
    assert [(w.process_id, w.load.num_used_blocks) for w in registry.workers()] == [("decode-0", 7)]
    assert [e.process_id for e in registry.by_role("gateway")] == ["gateway"]


def test_goodbye_removes_only_the_named_incarnation():
    registry = Registry(lease_s=2.0)
    registry.register("decode-0", "d2", "decode", "tcp://x:4", b"d", now=0.0)
    assert registry.remove("decode-0", "d1") is None
    assert registry.remove("decode-0", "d2") is not None
    assert registry.workers() == []
