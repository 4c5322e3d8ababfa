"""SIGKILL of each kind of process of a running node under a load of streams, and what it cost them.

A node (SmolLM2 when fetched, else the tiny test model) with one prefill and
two decode workers serves a batch of streams (greedy and seeded sampling,
through the Python client) undisturbed, then --runs times per scenario with
one process killed once every stream has a few tokens: decode-0 (its streams
move to decode-1), prefill-0, the controller, the gateway (the client
resumes its streams); the gateway again under streams with logprobs, half of
them typed as drafts; and decode-0 frozen (SIGSTOP) before the streams start,
so that the handoffs routed to it hang, then killed once every stream has
its first token (the gateway aborts those handoffs at the prefill worker,
which must keep their KV until the lease runs out and serve on). A second
node with a single decode worker measures the decode kill where the stream
must wait for the restarted worker.

For each run: streams lost (ended with an error), hung (no end within the
timeout), equal to the undisturbed run (tokens, and logprobs to float
rounding); for each stream the kill moved (the gateway logs its migration),
the time from the kill to its next token; the longest wait between two
tokens of a stream; and the time until the killed process runs again and the
node serves. The last line:

    chaos lost=L hung=H equal=E/T migrate_p50_ms=X recovery_p50_s=Y

(the migration and recovery figures of the two-decode node).
"""

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from pdrt.client import Client
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.chaos import KillRun, batch, freeze, run_streams, wait_restarted
from pdrt.testing.node import Node
from pdrt.testing.prompts import random_prompts
from pdrt.testing.tiny_model import build_tiny_model

KV_LEASE_S = 3.0  # short, so that the handoffs given up in the frozen scenario run out within a run


@dataclass(frozen=True)
class Scenario:
    label: str
    process: str  # the one killed
    kill_after: int  # tokens every stream has when it is
    delay_s: float = 0.0
    mixed: bool = False  # streams with logprobs, half typed as drafts
    frozen: bool = False  # SIGSTOP the process before the streams start


SCENARIOS = [Scenario("decode-0", "decode-0", 3), Scenario("prefill-0", "prefill-0", 0, 0.3),
             Scenario("controller", "controller", 3), Scenario("gateway", "gateway", 3),
             Scenario("gateway mixed", "gateway", 5, mixed=True),
             Scenario("decode-0 frozen", "decode-0", 1, frozen=True)]


def migrations(node: Node, run: KillRun) -> dict[str, int]:
    """Streams of `run` that the gateway moved to another worker because the kill failed them (not those a
    crowded decode worker sent on), each with its output tokens at the move."""
    by_request = {rid: name for name, rid in run.request_ids.items()}
    moved = {}
    for line in node.log_path.read_text().splitlines():
        if line.startswith("{") and '"migrating a request"' in line:
            event = json.loads(line)
            name = by_request.get(event.get("client_request_id"))
            if name is not None and not event.get("moved"):
                moved[name] = event["output_tokens"]
    return moved


def recovered(node: Node, process: str, run: KillRun, expected_workers: int) -> float:
    """Seconds from the kill until `process` runs again and the gateway lists every worker alive."""
    wait_restarted(node, process, run.killed_pid)
    with Client(node.address, timeout_s=60) as client:
        client.wait_ready(expected_workers=expected_workers, timeout_s=120)
    assert run.killed_at is not None
    return time.monotonic() - run.killed_at


def equal(run: KillRun, undisturbed: KillRun, name: str) -> bool:
    """The same tokens, and the same logprobs to float rounding (a continuation's are computed in other batches)."""
    same = run.results[name] == undisturbed.results[name]
    return same and all(abs(a - b) <= 1e-4 for a, b in zip(run.logprobs[name], undisturbed.logprobs[name],
                                                           strict=True))


def scenarios(node: Node, streams: dict, mixed: dict, runs: int, kinds: list[Scenario], num_workers: int,
              label: str) -> tuple[list[tuple[int, int, int, int]], list[float], list[float]]:
    undisturbed = {False: run_streams(node.address, streams), True: run_streams(node.address, mixed)}
    all_runs, migrate_ms, recovery_s = [], [], []
    print(f"\n{label}\n{'scenario':<18}{'run':>4}{'lost':>6}{'hung':>6}{'equal':>8}{'migrated':>10}"
          f"{'migrate ms':>12}{'gap max ms':>12}{'recovery s':>12}{'prefill':>9}", flush=True)
    for kind in kinds:
        batch_of = mixed if kind.mixed else streams
        for i in range(runs):
            prefill = node.child_pids()["prefill-0"]
            run = run_streams(node.address, batch_of, kill=(node, kind.process), kill_after=kind.kill_after,
                              kill_delay_s=kind.delay_s, before=freeze(node, kind.process) if kind.frozen else None)
            recovery = recovered(node, kind.process, run, num_workers)
            if kind.frozen:
                time.sleep(max(0.0, KV_LEASE_S + 1.0 - recovery))  # the abandoned handoffs' leases run out
            prefill_kept = kind.process == "prefill-0" or node.child_pids()["prefill-0"] == prefill
            moved = migrations(node, run)
            assert run.killed_at is not None
            # From the kill to the first token the new worker made: the one at the index the stream had reached.
            times = [1000 * (run.token_times[name][at] - run.killed_at) for name, at in moved.items()
                     if at < len(run.token_times[name])]
            same = sum(equal(run, undisturbed[kind.mixed], name) for name in batch_of)
            print(f"{kind.label:<18}{i + 1:>4}{len(run.lost()):>6}{len(run.hung()):>6}{same:>5}/{len(batch_of):<2}"
                  f"{len(moved):>10}{statistics.median(times) if times else float('nan'):>12.0f}"
                  f"{1000 * run.longest_gap_s():>12.0f}{recovery:>12.1f}{'kept' if prefill_kept else 'LOST':>9}",
                  flush=True)
            all_runs.append((len(run.lost()) + (not prefill_kept), len(run.hung()), same, len(batch_of)))
            migrate_ms += times
            recovery_s.append(recovery)
    return all_runs, migrate_ms, recovery_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2 if fetched, else a tiny model)")
    parser.add_argument("--runs", type=int, default=3, help="kills per scenario (default 3)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="pdrt-bench-chaos-"))
    model = args.model or (str(default_model_dir()) if is_fetched() else str(build_tiny_model(workdir / "tiny")))
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    # No stream ends early (EOS), so that every kill finds streams to move.
    prompts = random_prompts(args.streams, (16, 128), vocab, seed=0)
    streams = batch(prompts, args.max_tokens, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    mixed = batch([tokenizer.decode(p) if i % 4 >= 2 else p for i, p in enumerate(prompts)], args.max_tokens,
                  ignore_eos=True, logprobs=True)
    print(f"model {model}, {args.streams} streams of {args.max_tokens} tokens (half greedy, half seeded sampling; "
          f"mixed: with logprobs, half typed as drafts), {args.runs} kills per scenario", flush=True)
    settings = {"decode": {"count": 2}, "experimental": {"kv_lease_s": KV_LEASE_S}}
    with Node(workdir / "two", model, extra=settings, ready_timeout_s=300) as node:
        runs, migrate_ms, recovery_s = scenarios(node, streams, mixed, args.runs, SCENARIOS, 3,
                                                 "one prefill and two decode workers")
    with Node(workdir / "one", model, ready_timeout_s=300) as node:
        _, single_ms, single_s = scenarios(node, streams, mixed, args.runs, SCENARIOS[:1], 2,
                                           "one prefill and one decode worker (streams wait for its restart)")
    lost, hung, equal, total = (sum(column) for column in zip(*runs, strict=True))
    print(f"\nsingle decode worker: migrate p50 {statistics.median(single_ms):.0f} ms, recovery p50 "
          f"{statistics.median(single_s):.1f} s" if single_ms else "\nsingle decode worker: no stream migrated")
    p50 = statistics.median(migrate_ms) if migrate_ms else float("nan")
    print(f"chaos lost={lost} hung={hung} equal={equal}/{total} migrate_p50_ms={p50:.0f} "
          f"recovery_p50_s={statistics.median(recovery_s):.1f}")


if __name__ == "__main__":
    main()
