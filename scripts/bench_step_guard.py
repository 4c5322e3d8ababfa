"""What the step guard buys the other streams of a decode engine when a burst of long-context streams joins.

One engine in this process, one torch thread, decoding as a decode worker
does: NUM_OTHER short-prompt streams decode, then NUM_LONG streams with
LONG_PROMPT-token contexts join at once, their KV imported from a prefill
engine (computed once, before any run). The TPOT SLO is SLO_FACTOR times
the median step interval of the other streams with CALIBRATION_LONG long
ones. Each run steps the engine and, with the guard, calls it after every
step exactly as the worker's engine loop does (pdrt/roles/engine_worker.py).

Over the burst window (from the burst's arrival to the last long stream's
end) it takes, per stream, the mean interval between its tokens in the
window, counted from the arrival. The other streams end at staggered points
of the window, so the ones that end early see mostly the steps before the
guard has acted. Figures
are the medians of --repeats runs with and without the guard, in alternating
order; the outputs (greedy) must be equal. The last line:
`step_guard tpot_attainment_with=X without=Y long_streams_tpot_with=A without=B`
(attainment: the fraction of other streams whose TPOT is within the SLO;
long streams' TPOT: their median, in ms).
"""

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import structlog
import torch
from transformers.utils import logging as hf_logging

from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.engine.model_loader import LoadedModel, load_model
from pdrt.engine.step_guard import StepGuard
from pdrt.testing.prompts import random_prompts
from pdrt.testing.tiny_model import build_tiny_model

# A model wide and deep enough that a long context's attention, not Python, dominates a decode step.
MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=256,
             max_position_embeddings=8192)
NUM_OTHER, OTHER_PROMPT, WARMUP_STEPS = 8, 64, 10
NUM_LONG, LONG_PROMPT, LONG_OUTPUT = 6, 6000, 400
CALIBRATION_LONG, CALIBRATION_STEPS, SLO_FACTOR = 2, 40, 1.5
BLOCK_SIZE = 16


def engine_for(loaded: LoadedModel) -> LLMEngine:
    tokens = NUM_OTHER * (OTHER_PROMPT + 4 * LONG_OUTPUT) + NUM_LONG * (LONG_PROMPT + LONG_OUTPUT)
    return LLMEngine(EngineConfig(model="bench", num_blocks=tokens // BLOCK_SIZE + 4 * (NUM_OTHER + NUM_LONG),
                                  block_size=BLOCK_SIZE), loaded=loaded)


class Burst:
    """The long streams' prompts, prefilled once; `join` imports their KV into a decode engine."""

    def __init__(self, loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams) -> None:
        self.prefill, self.prompts, self.params = engine_for(loaded), prompts, params
        self.first: dict[str, tuple[int, list[int]]] = {}  # request id -> first token, KV blocks
        for i, prompt in enumerate(prompts):
            self.prefill.add_prefill(f"long{i}", prompt, params)
        while len(self.first) < len(prompts):
            for out in self.prefill.step():
                self.first[out.request_id] = (out.new_token_ids[0], out.kv_block_ids)

    def join(self, engine: LLMEngine, num: int) -> None:
        for i in range(num):
            rid = f"long{i}"
            first, src = self.first[rid]
            reservation = engine.reserve_import(rid, self.prompts[i], first, self.params)
            engine.pool.write_blocks(reservation.block_ids, self.prefill.pool.read_blocks(src))
            engine.commit_import(rid)


def start_others(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> dict[str, list[int]]:
    """The other streams, prefilled and decoding for WARMUP_STEPS; request id -> its tokens so far."""
    tokens: dict[str, list[int]] = {}
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"other{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        tokens[f"other{i}"] = []
    for _ in range(WARMUP_STEPS + 1):
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def calibrate(loaded: LoadedModel, burst: Burst, others: list[list[int]]) -> float:
    """The median step interval of the other streams with CALIBRATION_LONG long ones."""
    engine = engine_for(loaded)
    start_others(engine, others, [WARMUP_STEPS + CALIBRATION_STEPS + 10] * NUM_OTHER)
    burst.join(engine, CALIBRATION_LONG)
    engine.step()
    ends = []
    for _ in range(CALIBRATION_STEPS):
        engine.step()
        ends.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))


def run(loaded: LoadedModel, burst: Burst, others: list[list[int]], lengths: list[int], slo_s: float,
        guarded: bool) -> tuple[dict[str, list[float]], dict[str, list[int]], int]:
    """One burst: each stream's token times in the window (from the burst's arrival), all its tokens, and the
    demotions."""
    engine = engine_for(loaded)
    guard = StepGuard(engine.scheduler, slo_s)
    tokens = start_others(engine, others, lengths)
    burst.join(engine, NUM_LONG)
    arrived = time.perf_counter()
    tokens.update({f"long{i}": [] for i in range(NUM_LONG)})
    times = {rid: [arrived] for rid in tokens}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        if guarded:
            guard.stepped(now, bool(engine.last_batch.decodes))
        for out in outputs:
            times[out.request_id].append(now)
            tokens[out.request_id].extend(out.new_token_ids)
    window_end = max(times[f"long{i}"][-1] for i in range(NUM_LONG))
    in_window = {rid: [t for t in ts if t <= window_end] for rid, ts in times.items()}
    return in_window, tokens, engine.scheduler.num_demotions


def tpot(token_times: list[float]) -> float:
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(build_tiny_model(Path(tmp) / "tiny", **MODEL)))
    vocab = int(loaded.model.config.vocab_size)
    others = random_prompts(NUM_OTHER, OTHER_PROMPT, vocab, seed=1)
    # Staggered ends over the window the burst takes without the guard: LONG_OUTPUT steps.
    lengths = [WARMUP_STEPS + 1 + LONG_OUTPUT * (i + 1) // NUM_OTHER for i in range(NUM_OTHER)]
    burst = Burst(loaded, random_prompts(NUM_LONG, LONG_PROMPT, vocab, seed=2),
                  SamplingParams(temperature=0, max_tokens=LONG_OUTPUT, ignore_eos=True))
    interval = calibrate(loaded, burst, others)
    slo_s = SLO_FACTOR * interval
    print(f"tiny model {MODEL}, 1 thread: {NUM_OTHER} others of {OTHER_PROMPT} tokens, a burst of {NUM_LONG} "
          f"of {LONG_PROMPT}+{LONG_OUTPUT}; step with {CALIBRATION_LONG} long {interval * 1e3:.2f} ms, "
          f"TPOT SLO {slo_s * 1e3:.2f} ms")
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for repeat in range(args.repeats):
        outputs = {}
        line = []
        for guarded in (True, False) if repeat % 2 == 0 else (False, True):
            times, outputs[guarded], demotions = run(loaded, burst, others, lengths, slo_s, guarded)
            other = [tpot(t) for rid, t in times.items() if rid.startswith("other")]
            attainment = sum(t <= slo_s for t in other) / len(other)
            long_tpot = statistics.median(tpot(t) for rid, t in times.items() if rid.startswith("long"))
            results[guarded].append((attainment, long_tpot))
            line.append(f"{'with' if guarded else 'without'}: attainment {attainment:.3f}, others' TPOT "
                        f"{' '.join(f'{t * 1e3:.2f}' for t in other)} ms, long {long_tpot * 1e3:.2f} ms, "
                        f"{demotions} demotions")
        assert outputs[True] == outputs[False], "the guard changed an output"
        print(f"repeat {repeat + 1}: " + "; ".join(line))
    (att_with, long_with), (att_without, long_without) = (
        tuple(statistics.median(r[k] for r in results[g]) for k in (0, 1)) for g in (True, False))
    print(f"step_guard tpot_attainment_with={att_with:.3f} without={att_without:.3f} "
          f"long_streams_tpot_with={long_with * 1e3:.2f}ms without={long_without * 1e3:.2f}ms")


if __name__ == "__main__":
    main()
