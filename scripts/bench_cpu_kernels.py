"""pdrt's CPU kernels (compiled decode attention, oneDNN-packed linears) against torch's own ops, side by side.

Each measurement runs in a fresh process, once with the kernels (the default)
and once with PDRT_CPU_KERNELS=0 (MKL linears, KV gathered for SDPA), the two
alternating, --repeats times; medians are reported. Measured: one decode step
of B sequences with C tokens of context each (imported KV, so no prefill is
needed to set it up), at 1 and 2 torch threads, and one 512-token prefill
step. Model: SmolLM2 when fetched, else the tiny random model.

The last line gives the speed-ups (time without / time with the kernels):
`cpu_kernels decode_b20_1t=X decode_b20_2t=Y decode_b1_1t=Z prefill_512=W`.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = [(1, 300), (4, 300), (8, 300), (20, 500), (32, 800)]
THREADS = (1, 2)
STEPS = 6


def child(model: str) -> None:
    """Print one JSON object: seconds per decode step by (batch, context, threads), and per prefill step."""
    import torch

    from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
    from pdrt.engine.model_loader import load_model

    loaded = load_model(model)
    engine = LLMEngine(EngineConfig(model="bench", num_blocks=2048, enable_prefix_caching=False), loaded=loaded)
    engine.pool.tensor.normal_()  # attention reads every cached token; its values do not change the cost
    vocab = int(loaded.model.config.vocab_size)
    rng = random.Random(0)
    results: dict[str, float] = {}
    for threads in THREADS:
        torch.set_num_threads(threads)
        engine.add_request("prefill", [rng.randrange(5, vocab) for _ in range(512)],
                           SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        engine.step()
        results[f"prefill_512_{threads}t"] = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for batch, context in SHAPES:
        ids = [f"{batch}x{context}-{i}" for i in range(batch)]
        for rid in ids:
            engine.reserve_import(rid, [rng.randrange(5, vocab) for _ in range(context)], 5, params)
            engine.commit_import(rid)
        for threads in THREADS:
            torch.set_num_threads(threads)
            engine.step()
            times = []
            for _ in range(STEPS):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            results[f"decode_b{batch}_c{context}_{threads}t"] = statistics.median(times)
        for rid in ids:
            engine.abort(rid)
    print(json.dumps(results))


def measure(model: str, kernels: bool) -> dict[str, float]:
    env = {**os.environ, "PDRT_CPU_KERNELS": "1" if kernels else "0"}
    out = subprocess.run([sys.executable, __file__, "--child", model], env=env, capture_output=True, text=True,
                         check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2 if fetched, else the tiny model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    from pdrt.models.fetch import default_model_dir, is_fetched
    from pdrt.testing.tiny_model import build_tiny_model

    model = args.model or (str(default_model_dir()) if is_fetched() else
                           str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")))
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for kernels in (True, False):
            runs[kernels].append(measure(model, kernels))
    median = {k: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for k, rs in runs.items()}
    print(f"model {Path(model).name}; {os.cpu_count()} CPU cores; medians of {args.repeats}")
    print(f"{'step':24s} {'kernels ms':>11s} {'torch ms':>9s} {'speed-up':>9s}")
    for key, with_kernels in median[True].items():
        without = median[False][key]
        print(f"{key:24s} {with_kernels * 1000:11.1f} {without * 1000:9.1f} {without / with_kernels:9.2f}")

    def ratio(key: str) -> float:
        return median[False][key] / median[True][key]

    print(f"cpu_kernels decode_b20_1t={ratio('decode_b20_c500_1t'):.2f} "
          f"decode_b20_2t={ratio('decode_b20_c500_2t'):.2f} decode_b1_1t={ratio('decode_b1_c300_1t'):.2f} "
          f"prefill_512={ratio('prefill_512_1t'):.2f}")


if __name__ == "__main__":
    main()
