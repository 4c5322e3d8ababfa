"""Hostile input to every port of a running `pdrt up`, and what it did (pdrt/testing/fuzz.py).

Starts a node (SmolLM2 when fetched, else the tiny test model) with its HTTP
front, the UDP warmup channel and KV over TCP, so that every port it can
open is open and its KV server is on every request's path. Then --inputs
inputs go to each port (client ROUTER, HTTP, UDP, controller, gateway
inbox, every worker inbox, every KV server; the internal ones from sockets
without the key, with another key, and with the key) while a well-behaved
client checks that its greedy answers stay those of an undisturbed run.
The last line:

    fuzz inputs=N crashes=C hangs=H lost=L unauthenticated_accepted=U rss_growth_mb=M stall_max_ms=S valid_hostile=V

where S is the longest wait between two frames of the well-behaved client's
streams while the fuzz ran, and V the valid but hostile requests among the
inputs (every field at its limit; floods of drafts, warmups, sessions,
continuations and handshakes; cancels that cross a handoff).
"""

import argparse
import json
import secrets
import tempfile
from pathlib import Path

from pdrt.actors.cluster_key import ClusterKey
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.fuzz import run_fuzz
from pdrt.testing.node import Node, free_port
from pdrt.testing.prompts import random_prompts
from pdrt.testing.tiny_model import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2 if fetched, else a tiny model)")
    parser.add_argument("--inputs", type=int, default=2000, help="inputs per port (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="pdrt-bench-fuzz-"))
    model = args.model or (str(default_model_dir()) if is_fetched() else str(build_tiny_model(workdir / "tiny")))
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    key, warmup_key = ClusterKey.generate(), secrets.token_hex(16)
    http_port, udp_port = free_port(), free_port()
    with Node(workdir, model, transfer="tcp", ready_timeout_s=300,
              extra={"cluster_key": key.text, "gateway": {"http_port": http_port},
                     "warmup": {"key": warmup_key, "port": udp_port}}) as node:
        print(f"model {model}, {args.inputs} inputs per port, node log {node.log_path}", flush=True)
        report = run_fuzz(node, key, warmup_key, f"http://127.0.0.1:{http_port}", udp_port, args.inputs,
                          random_prompts(4, 24, vocab, seed=args.seed), args.seed)
    print("inputs per port:", json.dumps(report.per_port))
    print("resident memory growth, MiB:", json.dumps(report.rss_growth_by_process))
    print(f"http 500s {report.server_errors}, well-behaved requests {report.sentinel_requests}, insider frames "
          f"undelivered {report.undelivered}")
    print(f"valid hostile requests answered with errors: {json.dumps(report.refusals)}; the well-behaved client's "
          f"longest wait for a first frame {report.first_frame_max_ms:.0f} ms, between frames "
          f"{report.stall_max_ms:.0f} ms")
    print(report.line())


if __name__ == "__main__":
    main()
