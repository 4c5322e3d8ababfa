"""Hostile input to every port of a real node (tiny model, KV over TCP so that its KV server is on every request's
path), while a well-behaved client checks its answers: nothing exits, hangs, is lost or changed, nobody without the
cluster key completes a handshake, and memory stays bounded. scripts/bench_fuzz.py runs the same at any size."""

from typing import get_args

from hypothesis import given, settings
from hypothesis import strategies as st

from pdrt.actors.cluster_key import ClusterKey
from pdrt.roles.client_frames import decode_client_frames
from pdrt.testing.fuzz import run_fuzz
from pdrt.testing.node import Node, free_port
from pdrt.wire import ClientRequest, Error

INPUTS_PER_PORT = 300
RSS_BOUND_MB = 300
WARMUP_KEY = "fuzz-warmup-key"


@given(st.lists(st.binary(max_size=300), min_size=0, max_size=3))
@settings(max_examples=300, deadline=None)
def test_any_client_frames_decode_into_a_request_or_an_error_never_an_exception(frames):
    assert isinstance(decode_client_frames(frames), (Error, *get_args(ClientRequest)))


def test_every_port_survives_hostile_input_with_nothing_lost_hung_or_let_in(model_dirs, tmp_path, prompts):
    key = ClusterKey.generate()
    http_port, udp_port = free_port(), free_port()
    with Node(tmp_path, str(model_dirs["llama"]), transfer="tcp",
              extra={"cluster_key": key.text, "gateway": {"http_port": http_port},
                     "warmup": {"key": WARMUP_KEY, "port": udp_port}}) as node:
        report = run_fuzz(node, key, WARMUP_KEY, f"http://127.0.0.1:{http_port}", udp_port, INPUTS_PER_PORT,
                          [p[:40] for p in prompts[3:7]])
    print(report.line(), report.per_port)
    assert len(report.per_port) >= 8  # client, http, udp, controller, gateway inbox, 2 workers, a KV server
    assert report.inputs >= INPUTS_PER_PORT * len(report.per_port)
    assert (report.crashes, report.hangs, report.lost, report.unauthenticated_accepted, report.server_errors) == (
        0, 0, 0, 0, 0), report.line()
    assert report.rss_growth_mb < RSS_BOUND_MB, report.line()
