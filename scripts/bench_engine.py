"""pdrt's engine against transformers' own paths, side by side in one run.

Measures, on the same model with the same torch thread count:
  (a) prefill tokens/s of 512-token prompts: pdrt's engine against a
      transformers forward pass with DynamicCache (the better of one prompt
      per forward and all prompts in one batched forward);
  (b) decode tokens/s at batch 1, 8 and 32: pdrt's engine against a
      transformers forward loop over DynamicCache (greedy, no EOS);
  (c) a 64-request workload of mixed prompt lengths through pdrt against
      `model.generate_batch` (transformers' continuous batching).
Each figure is the median of --repeats runs, pdrt and transformers
alternating; a run repeats its measurement until it has lasted a second.
The last line gives the ratios pdrt/transformers on the tiny model:
`engine_vs_hf decode_b32=X prefill=Y workload=Z`.
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.utils import logging as hf_logging

from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.engine.config import DEFAULT_PREFILL_CHUNK
from pdrt.engine.model_loader import load_model
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.prompts import random_prompts
from pdrt.testing.tiny_model import build_tiny_model

PREFILL_LEN, PREFILL_PROMPTS = 512, 8
DECODE_PROMPT_LEN, DECODE_STEPS = 128, 64
WORKLOAD_REQUESTS, WORKLOAD_NEW_TOKENS = 64, 64
MIN_SECONDS = 1.0


class Pdrt:
    def __init__(self, path: str, chunk: int) -> None:
        self.loaded = load_model(path)
        self.chunk = chunk
        self.vocab = int(self.loaded.model.config.vocab_size)

    def engine(self) -> LLMEngine:
        # Prefix caching off: the timed runs repeat prompts, which would turn prefill into cache hits.
        config = EngineConfig(model="bench", max_prefill_chunk_size=self.chunk, max_num_batched_tokens=2048,
                              num_blocks=4096, enable_prefix_caching=False)
        return LLMEngine(config, loaded=self.loaded)

    def prefill(self, prompts: list[list[int]]) -> tuple[int, float]:
        engine = self.engine()
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return sum(map(len, prompts)), time.perf_counter() - start

    def decode(self, prompts: list[list[int]], steps: int) -> tuple[int, float]:
        engine = self.engine()
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        started = 0
        while started < len(prompts):  # prefill until every request has its first token
            started += sum(1 for o in engine.step() if o.new_token_ids)
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        return tokens, time.perf_counter() - start

    def workload(self, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
        engine = self.engine()
        start = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        return sum(map(len, outs)), time.perf_counter() - start


class HF:
    def __init__(self, path: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()

    @torch.inference_mode()
    def prefill_one_by_one(self, prompts: list[list[int]]) -> tuple[int, float]:
        start = time.perf_counter()
        for p in prompts:
            self.model(torch.tensor([p]), cache=DynamicCache(), use_cache=True, logits_to_keep=1)
        return sum(map(len, prompts)), time.perf_counter() - start

    @torch.inference_mode()
    def prefill_batched(self, prompts: list[list[int]]) -> tuple[int, float]:
        start = time.perf_counter()
        self.model(torch.tensor(prompts), cache=DynamicCache(), use_cache=True, logits_to_keep=1)
        return sum(map(len, prompts)), time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> tuple[int, float]:
        cache = DynamicCache()
        ids = torch.tensor(prompts)
        logits = self.model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
        position = ids.shape[1]
        start = time.perf_counter()
        for _ in range(steps):
            pos = torch.full((len(prompts), 1), position)
            logits = self.model(next_ids, cache=cache, use_cache=True, position_ids=pos).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
            position += 1
        return len(prompts) * steps, time.perf_counter() - start

    def workload(self, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        start = time.perf_counter()
        outs = self.model.generate_batch(prompts, generation_config=config)
        return sum(len(o.generated_tokens) for o in outs.values()), time.perf_counter() - start


def sustained(run: Callable[[], tuple[int, float]], min_seconds: float = MIN_SECONDS) -> float:
    """Tokens/s of `run` repeated until it has taken `min_seconds`: one run of a tiny model lasts
    milliseconds, which a shared machine's noise would swamp."""
    tokens, seconds = 0, 0.0
    while seconds < min_seconds:
        n, s = run()
        tokens, seconds = tokens + n, seconds + s
    return tokens / seconds


def median_pair(run_pdrt: Callable[[], float], run_hf: Callable[[], float], repeats: int) -> tuple[float, float]:
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(run_pdrt())
        theirs.append(run_hf())
    return statistics.median(ours), statistics.median(theirs)


def bench_model(name: str, path: str, repeats: int, chunk: int) -> dict[str, float]:
    pdrt, hf = Pdrt(path, chunk), HF(path)
    vocab = pdrt.vocab
    rows: dict[str, tuple[float, float]] = {}
    prefill_prompts = random_prompts(PREFILL_PROMPTS, PREFILL_LEN, vocab, seed=1)
    pdrt.prefill(prefill_prompts[:1]), hf.prefill_one_by_one(prefill_prompts[:1])  # warm up both
    rows["prefill_512"] = median_pair(
        lambda: sustained(lambda: pdrt.prefill(prefill_prompts)),
        lambda: max(sustained(lambda: hf.prefill_one_by_one(prefill_prompts)),
                    sustained(lambda: hf.prefill_batched(prefill_prompts))), repeats)
    for batch in (1, 8, 32):
        prompts = random_prompts(batch, DECODE_PROMPT_LEN, vocab, seed=batch)
        rows[f"decode_b{batch}"] = median_pair(lambda p=prompts: sustained(lambda: pdrt.decode(p, DECODE_STEPS)),
                                               lambda p=prompts: sustained(lambda: hf.decode(p, DECODE_STEPS)),
                                               repeats)
    workload = random_prompts(WORKLOAD_REQUESTS, (16, 512), vocab, seed=7)
    rows["workload_64"] = median_pair(lambda: sustained(lambda: pdrt.workload(workload, WORKLOAD_NEW_TOKENS)),
                                      lambda: sustained(lambda: hf.workload(workload, WORKLOAD_NEW_TOKENS)),
                                      repeats)
    print(f"\n[{name}] {path}  threads={torch.get_num_threads()}  chunk={chunk}  median of {repeats}")
    print(f"{'measure':<14}{'pdrt tok/s':>12}{'hf tok/s':>12}{'pdrt/hf':>9}")
    for key, (ours, theirs) in rows.items():
        print(f"{key:<14}{ours:>12.1f}{theirs:>12.1f}{ours / theirs:>9.2f}")
    return {key: ours / theirs for key, (ours, theirs) in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--skip-smollm2", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not args.skip_smollm2:
        if is_fetched():
            bench_model("smollm2", str(default_model_dir()), args.repeats, args.chunk)
        else:
            print("SmolLM2 not fetched (pdrt model fetch); skipping it")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny")
        ratios = bench_model("tiny", str(tiny), args.repeats, args.chunk)
    print(f"engine_vs_hf decode_b32={ratios['decode_b32']:.2f} prefill={ratios['prefill_512']:.2f} "
          f"workload={ratios['workload_64']:.2f}")


if __name__ == "__main__":
    main()
