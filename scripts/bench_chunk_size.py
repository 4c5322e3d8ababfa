"""How `max_prefill_chunk_size` trades prefill throughput against decode stalls.

For each chunk size: prefill tokens/s of 2048-token prompts alone, and the
mean and worst decode-step time of 16 running requests while 2048-token
prompts are prefilled in the same steps (the stall a long prompt puts on
every stream that is decoding, which chunking bounds). Medians of --repeats
runs, on SmolLM2 when fetched, else on the tiny test model.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.engine.model_loader import load_model
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.prompts import random_prompts
from pdrt.testing.tiny_model import build_tiny_model

CHUNKS = (64, 128, 256, 512, 1024, 2048)
LONG, NUM_LONG, NUM_DECODING = 2048, 2, 16


def engine_for(loaded, chunk: int) -> LLMEngine:
    config = EngineConfig(model="bench", max_prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 512),
                          num_blocks=2048, enable_prefix_caching=False)
    return LLMEngine(config, loaded=loaded)


def prefill_rate(loaded, chunk: int, prompts: list[list[int]]) -> float:
    engine = engine_for(loaded, chunk)
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def decode_stall(loaded, chunk: int, decoding: list[list[int]], long: list[list[int]]) -> tuple[float, float]:
    engine = engine_for(loaded, chunk)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i, p in enumerate(decoding):
        engine.add_request(f"d{i}", p, params)
    while any(s.num_output_tokens == 0 for s in engine.sequences.values()):
        engine.step()
    for i, p in enumerate(long):
        engine.add_request(f"l{i}", p, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    step_times = []
    while any(r.startswith("l") for r in engine.sequences):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    return statistics.mean(step_times) * 1e3, max(step_times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(default_model_dir()) if is_fetched() else str(build_tiny_model(Path(tmp) / "tiny"))
        loaded = load_model(path)
        vocab = int(loaded.model.config.vocab_size)
        long = random_prompts(NUM_LONG, LONG, vocab, seed=3)
        decoding = random_prompts(NUM_DECODING, 64, vocab, seed=4)
        print(f"{path}  threads={args.threads}  median of {args.repeats}")
        print(f"{'chunk':>6}{'prefill tok/s':>15}{'step ms mean':>14}{'step ms max':>13}")
        for chunk in CHUNKS:
            rates = [prefill_rate(loaded, chunk, long) for _ in range(args.repeats)]
            stalls = [decode_stall(loaded, chunk, decoding, long) for _ in range(args.repeats)]
            print(f"{chunk:>6}{statistics.median(rates):>15.0f}{statistics.median(s[0] for s in stalls):>14.1f}"
                  f"{statistics.median(s[1] for s in stalls):>13.1f}")


if __name__ == "__main__":
    main()
