"""Streams spread over the decode workers: a prefill worker that becomes a decode worker takes over half the
streams of the crowded one, on a real node with the tiny model, every stream unchanged (greedy and seeded
sampling) and no KV block left held; and when the controller asks for it."""

import re

import pytest
from prometheus_client import CollectorRegistry

from pdrt.actors.cluster_key import ClusterKey
from pdrt.control_plane.registry import Registry
from pdrt.control_plane.set_role import set_role
from pdrt.control_plane.stream_balance import COOLDOWN_S, JOINED_S, StreamBalance
from pdrt.testing.chaos import batch, run_streams
from pdrt.testing.node import Node
from pdrt.wire import Load, RoleChanged, ShedStreams
from tests.system_client import used_blocks, wait_for

KEY = ClusterKey.generate()


@pytest.fixture(scope="module")
def streams(prompts):
    return batch([p[:200] for p in prompts[3:11]], 400, ignore_eos=True)


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    # a TPOT SLO that every step misses: the crowded decode worker is always over it
    with Node(tmp_path_factory.mktemp("shed"), str(model_dirs["llama"]),
              extra={"cluster_key": KEY.text, "prefill": {"count": 2}, "gateway": {"tpot_slo_s": 0.0001}}) as running:
        yield running


def shed(node: Node) -> list[int]:
    """How many streams each "streams sent on" event of the node's decode workers moved."""
    lines = [line for line in node.log_path.read_text().splitlines() if '"event": "streams sent on"' in line]
    return [int(m.group(1)) for m in map(re.compile(r'"moved": (\d+)').search, lines) if m]


def test_a_new_decode_worker_takes_half_the_streams_of_the_crowded_one_and_none_changes(node, streams):
    undisturbed = run_streams(node.address, streams).results  # all on decode-0, the only decode worker
    assert shed(node) == []
    controller = f"tcp://127.0.0.1:{node.controller_port}"
    run = run_streams(node.address, streams, disturb=lambda: set_role(controller, KEY, "prefill-1", "decode"),
                      kill_after=20)
    assert isinstance(run.disturbance, RoleChanged)
    assert sum(shed(node)) >= 3  # half the gap of 8 streams, at once or in steps
    assert not run.lost() and not run.hung() and run.results == undisturbed
    wait_for(lambda: set(used_blocks(node).values()) == {0}, timeout_s=30, interval_s=0.2)


def decode_workers(*loads: tuple[int, float]) -> Registry:
    registry = Registry(lease_s=2.0)
    for i, (streams, step_s) in enumerate(loads):
        registry.register(f"decode-{i}", "a", "decode", f"tcp://d{i}", f"d{i}".encode(), now=0.0)
        registry.heartbeat(f"decode-{i}", "a", Load(num_running=streams, step_s=step_s), now=0.0)
    return registry


def balance(registry: Registry, pending: set[str] = frozenset(), enabled: bool = True):
    sent: list[tuple[bytes, ShedStreams]] = []
    return StreamBalance(registry, lambda identity, m: sent.append((identity, m)), lambda: set(pending), enabled,
                         0.01, CollectorRegistry()), sent


@pytest.mark.parametrize(("loads", "asked"), [
    (((8, 0.02), (0, 0.0)), [(b"d0", 4)]),  # over the SLO, a gap of 8: half of it
    (((3, 0.0), (9, 0.03), (6, 0.0)), [(b"d1", 3)]),  # the most crowded sheds, toward the emptiest
    (((8, 0.005), (0, 0.0)), []),  # under the SLO: its streams are served, a move would cost a prefill
    (((5, 0.02), (4, 0.0)), []),  # a gap of one moves nothing
    (((25, 0.02), (22, 0.009)), []),  # a gap small against the load: both are crowded, a move changes neither
    (((20, 0.02), (10, 0.012)), []),  # the fewest misses the SLO too: moved streams would go on missing it
    (((16, 0.012), (8, 0.006)), [(b"d0", 4)]),
    (((8, 0.02),), []),  # no other decode worker
])
def test_the_crowded_decode_worker_sheds_half_the_gap_only_while_over_the_slo_to_one_within_it(loads, asked):
    streams, sent = balance(decode_workers(*loads))
    streams.tick(now=10.0)
    assert [(identity, m.count) for identity, m in sent] == asked


def test_a_move_waits_out_the_cooldown_and_workers_changing_roles_take_no_part():
    registry = decode_workers((8, 0.02), (0, 0.0))
    streams, sent = balance(registry)
    assert streams.tick(now=10.0) == 4
    assert streams.tick(now=10.0 + COOLDOWN_S / 2) == 0
    assert streams.tick(now=10.0 + COOLDOWN_S) == 4  # the loads did not change: asked again
    assert balance(registry, pending={"decode-1"})[0].tick(now=10.0) == 0
    assert balance(registry, enabled=False)[0].tick(now=10.0) == 0


def test_a_worker_that_just_became_a_decode_worker_takes_half_the_gap_once_whatever_the_step_time():
    registry = decode_workers((8, 0.005), (0, 0.0))  # under the SLO: no move for its own sake
    streams, sent = balance(registry)
    assert streams.tick(now=10.0) == 0
    streams.join("decode-1", now=10.0)
    assert streams.tick(now=10.0) == 4 and sent[-1][0] == b"d0"
    assert streams.tick(now=10.0 + COOLDOWN_S) == 0  # once: then the step times decide again
    streams.join("decode-1", now=20.0)
    assert streams.tick(now=20.0 + JOINED_S) == 0  # too late: the loads have moved on since
    few, _ = balance(decode_workers((1, 0.005), (0, 0.0)))
    few.join("decode-1", now=30.0)
    assert few.tick(now=30.0) == 0  # too few to move
