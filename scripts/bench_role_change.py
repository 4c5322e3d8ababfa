"""How long a worker takes to change its role in place, with streams running through it, against a cold start.

A disaggregated node (one prefill and two decode workers, a thread each) serves a batch of streams (greedy
and seeded sampling). Once every stream has a few tokens, decode-0 becomes a prefill worker (its streams go
on at decode-1 as continuations), then, with the next batch, back; --repeats times. For each change: the
time from the controller's decision to the worker's `RoleChanged` (the worker serving its new role), the
time the operator waited (`pdrt role`'s round trip), and the streams it moved. Every stream's output must
equal an undisturbed run's. The comparison: a new worker process's cold start (weights, KV pool, first
steps) measured here as the time `pdrt up` takes to report ready, and the 8 s pod start of the article
behind pdrt.

Last line: `role_change flip_ms=X operator_ms=Y moved=M cold_start_ms=C equal=E/T`, medians.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pdrt.actors.cluster_key import ClusterKey
from pdrt.control_plane.set_role import set_role
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.chaos import batch, run_streams
from pdrt.testing.node import Node
from pdrt.testing.tiny_model import build_tiny_model

KEY = ClusterKey.generate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="checkpoint directory, 'tiny' (default) or 'smollm2'")
    parser.add_argument("--repeats", type=int, default=5, help="changes each way")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-role-change-"))
    if args.model == "tiny":
        model = str(build_tiny_model(workdir / "tiny"))
    elif args.model == "smollm2":
        if not is_fetched():
            raise SystemExit("run `pdrt model fetch` first")
        model = str(default_model_dir())
    else:
        model = args.model
    prompts = [[(i * 131 + j * 7) % 900 + 5 for j in range(48 + 16 * i)] for i in range(args.streams)]
    streams = batch(prompts, args.max_tokens, ignore_eos=True)
    node = Node(workdir, model, extra={"cluster_key": KEY.text, "decode": {"count": 2},
                                       "experimental": {"prefill_threads": 1, "decode_threads": 1}},
                ready_timeout_s=300)
    started = time.perf_counter()
    node.start()
    cold_start = time.perf_counter() - started
    controller = f"tcp://127.0.0.1:{node.controller_port}"
    flips, operator, moved, equal, total = [], [], [], 0, 0
    try:
        undisturbed = run_streams(node.address, streams).results
        for i in range(2 * args.repeats):
            role = "prefill" if i % 2 == 0 else "decode"

            async def change(role: str = role):
                asked = time.perf_counter()
                changed = await set_role(controller, KEY, "decode-0", role)
                operator.append(1e3 * (time.perf_counter() - asked))
                return changed

            run = run_streams(node.address, streams, disturb=change)
            moved.append(run.disturbance.moved)
            equal += sum(run.results[name] == undisturbed[name] for name in streams)
            total += len(streams)
        flips = node.role_changes_ms()
    finally:
        node.stop()
    print(f"cold start of a node (pdrt up to ready): {cold_start * 1e3:.0f} ms")
    print("role changes, decision to serving (ms): " + " ".join(f"{f:.0f}" for f in flips))
    print("operator round trips (ms): " + " ".join(f"{f:.0f}" for f in operator))
    print("streams moved per change: " + " ".join(map(str, moved)))
    print(f"role_change flip_ms={statistics.median(flips):.0f} operator_ms={statistics.median(operator):.0f} "
          f"moved={statistics.median(moved):g} cold_start_ms={cold_start * 1e3:.0f} equal={equal}/{total}")


if __name__ == "__main__":
    main()
