"""Workers of a disaggregated node change roles in place under a load of streams, on a real node with the tiny
model: no stream is lost or changed (greedy and seeded sampling), the gateways route by the new roles, no KV
block is left held, a change that would leave a role without workers is refused, and a worker killed during its
change ends it unmade, its streams moved on."""

import asyncio
import os
import signal
import time

import pytest

from pdrt.actors.cluster_key import ClusterKey
from pdrt.control_plane.set_role import set_role
from pdrt.errors import InvalidRequestError, PdrtError, WorkerLostError
from pdrt.testing.chaos import batch, run_streams, wait_restarted
from pdrt.testing.node import Node
from pdrt.wire import RoleChanged
from tests.system_client import node_status, used_blocks, wait_for

KEY = ClusterKey.generate()
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def streams(prompts):
    return batch([p[:300] for p in prompts[3:11]], MAX_TOKENS)


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    with Node(tmp_path_factory.mktemp("roles"), str(model_dirs["llama"]),
              extra={"cluster_key": KEY.text, "decode": {"count": 2}}) as running:
        running.controller = f"tcp://127.0.0.1:{running.controller_port}"
        yield running


@pytest.fixture(scope="module")
def undisturbed(node, streams):
    return run_streams(node.address, streams).results


def roles(node: Node) -> dict[str, str]:
    return {w.process_id: w.role for w in node_status(node).workers}


def change(node: Node, process: str, role: str):
    return lambda: set_role(node.controller, KEY, process, role)


def test_a_decode_worker_becomes_a_prefill_worker_mid_stream_and_its_streams_go_on_unchanged(node, streams,
                                                                                             undisturbed):
    run = run_streams(node.address, streams, disturb=change(node, "decode-0", "prefill"))
    assert isinstance(run.disturbance, RoleChanged) and run.disturbance.role == "prefill"
    assert run.disturbance.moved > 0  # it was decoding some of them
    assert not run.lost() and not run.hung() and run.results == undisturbed
    assert roles(node) == {"prefill-0": "prefill", "decode-0": "prefill", "decode-1": "decode"}
    assert run_streams(node.address, streams).results == undisturbed  # served by the new split


def test_the_last_decode_worker_cannot_change_and_a_prefill_worker_becomes_one_mid_stream(node, streams,
                                                                                          undisturbed):
    with pytest.raises(InvalidRequestError, match="last decode worker"):
        asyncio.run(change(node, "decode-1", "prefill")())
    run = run_streams(node.address, streams, disturb=change(node, "prefill-0", "decode"), kill_after=0)
    assert isinstance(run.disturbance, RoleChanged) and run.disturbance.moved == 0  # its prompts finish there
    assert not run.lost() and not run.hung() and run.results == undisturbed
    assert roles(node) == {"prefill-0": "decode", "decode-0": "prefill", "decode-1": "decode"}
    run = run_streams(node.address, streams, disturb=change(node, "decode-1", "prefill"))
    assert run.results == undisturbed
    wait_for(lambda: set(used_blocks(node).values()) == {0}, timeout_s=30, interval_s=0.2)


def test_pdrt_role_changes_a_role_from_the_command_line(node):
    import subprocess
    import sys

    def pdrt_role(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdrt.cli", "role", *args, "--controller", node.controller],
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PDRT_CLUSTER_KEY=KEY.text))

    done = pdrt_role("decode-1", "decode")
    assert done.returncode == 0 and done.stdout.startswith("decode-1 serves as a decode worker"), done.stderr
    assert roles(node)["decode-1"] == "decode"
    refused = pdrt_role("decode-1", "decode")
    assert refused.returncode == 2 and "is a decode worker already" in refused.stderr


def test_a_worker_killed_during_its_role_change_loses_no_stream_and_the_operator_hears_at_once(node, streams,
                                                                                               undisturbed):
    async def stop_change_kill():
        """decode-1 frozen, so that it gets ChangeRole and dies before it can answer."""
        pid = node.child_pids()["decode-1"]
        os.kill(pid, signal.SIGSTOP)
        asked = asyncio.create_task(set_role(node.controller, KEY, "decode-1", "prefill"))
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        try:
            return await asked
        except PdrtError as exc:
            return exc, time.monotonic(), pid

    run = run_streams(node.address, streams, disturb=stop_change_kill)
    error, answered_at, pid = run.disturbance
    assert isinstance(error, WorkerLostError) and "died before it served as a prefill worker" in str(error)
    assert answered_at - run.killed_at < 3.0  # the supervisor's word, not a timeout
    assert not run.lost() and not run.hung() and run.results == undisturbed
    wait_restarted(node, "decode-1", pid)
    wait_for(lambda: roles(node) == {"prefill-0": "decode", "decode-0": "prefill", "decode-1": "decode"},
             timeout_s=30)  # the new incarnation serves the role it was started as
    assert run_streams(node.address, streams).results == undisturbed
    wait_for(lambda: set(used_blocks(node).values()) == {0}, timeout_s=30, interval_s=0.2)
