"""`pdrt profile`: a model's step times on this machine, measured through pdrt's own engine, and saved.

What is measured, for each thread count a worker may run with (1 up to the
host's cores, doubling):

* prefill: one prompt of n tokens in one step, for n from 16 to the context
  (doubling), and prompts of n new tokens over a cached prefix of c tokens;
* decode: one step of B sequences (1 to 64, doubling) at contexts of 64 to
  1024 tokens (capped by the model's context).

Each point is the median of a few repeats after a warm-up step, the lower
of two passes over the grid (a shared host's slow spells last seconds).
The samples and their fits (pdrt.planner.cost_model) are saved as JSON, by
default under the pdrt cache named after the model and this host's CPU,
where `pdrt plan` and the controller's balancer find them.
"""

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdrt.errors import ConfigError
from pdrt.planner.cost_model import CostModel, ThreadsFit, fit_step, prefill_attention
from pdrt.planner.simulator import Overheads

FORMAT = 1
REPEATS = 3
# Passes over the whole grid; each point keeps its fastest pass. A shared host's slow spells last seconds and
# would put a point tens of percent above the fit; a pass later spares it.
PASSES = 2
MAX_BATCH = 64
DECODE_CONTEXTS = (64, 256, 1024)
CACHED_PREFIXES = (256, 1024)
BLOCK_SIZE = 16
MAX_POOL_BYTES = 2 << 30  # the largest batches at the longest contexts are left out of a bigger model's profile


@dataclass(slots=True)
class Profile:
    model: str
    host: str  # the CPU model name (or the platform), which the step times belong to
    cores: int
    kv_bytes_per_token: int
    max_model_len: int
    num_params: int
    # threads -> [(new tokens, cached tokens, seconds)] and [(batch, context tokens summed, seconds)]
    prefill: dict[int, list[tuple[int, int, float]]] = field(default_factory=dict)
    decode: dict[int, list[tuple[int, int, float]]] = field(default_factory=dict)
    # What serving adds to the steps (pdrt.planner.overheads), measured on a running node; empty: not measured
    overheads: dict[str, float] = field(default_factory=dict)
    measured: bool = True  # False: written by hand or scaled from another machine's, not measured here
    format: int = FORMAT

    def cost_model(self) -> CostModel:
        fits = {}
        for threads in sorted(self.prefill):
            prefill = fit_step([(n, prefill_attention(n, c), s) for n, c, s in self.prefill[threads]])
            decode = fit_step([(b, ctx, s) for b, ctx, s in self.decode[threads]])
            fits[threads] = ThreadsFit(prefill, decode)
        return CostModel(fits, self.kv_bytes_per_token, self.num_params)

    def serving_overheads(self) -> Overheads:
        return Overheads(**self.overheads)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        fits = {t: asdict(f) for t, f in self.cost_model().fits.items()}
        path.write_text(json.dumps({**asdict(self), "fits": fits}, indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the profile {path}: {exc}") from exc
        if data.get("format") != FORMAT:
            raise ConfigError(f"{path} is not a pdrt profile of format {FORMAT}; run `pdrt profile` again")
        data.pop("fits", None)
        for key in ("prefill", "decode"):
            data[key] = {int(t): [tuple(s) for s in samples] for t, samples in data[key].items()}
        return cls(**data)


def host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_profile_path(model: str) -> Path:
    """Where `pdrt profile` saves a model's profile for this host, and where the balancer looks for it."""
    from pdrt.models.fetch import cache_dir

    cpu = "".join(c if c.isalnum() else "-" for c in host_cpu()).strip("-").lower()[:48]
    return cache_dir() / "profiles" / f"{Path(model).name}--{cpu}--{os.cpu_count() or 1}cores.json"


def thread_counts(cores: int) -> list[int]:
    counts, t = [], 1
    while t < cores:
        counts.append(t)
        t *= 2
    return counts + [cores]


def _median_time(run: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class StepBench:
    """One engine, stepped by hand: each call times one kind of step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.vocab = max(8, min(engine.vocab_size, 32000) - 8)
        self.counter = 0

    def _tokens(self, n: int) -> list[int]:
        self.counter += 1
        base = self.counter * 7919
        return [4 + (base + i * 31) % self.vocab for i in range(n)]

    def _run(self, prompt: list[int], max_tokens: int) -> str:
        from pdrt.engine.sampling_params import SamplingParams

        rid = f"p{self.counter}-{len(prompt)}"
        self.counter += 1
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def prefill(self, new: int, cached: int, repeats: int) -> float:
        times = []
        for _ in range(repeats + 1):
            prefix = self._tokens(cached) if cached else []
            if cached:
                self._run(prefix, 1)
                self._drain()
            self._run(prefix + self._tokens(new), 1)
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
            self._drain()
        return statistics.median(times[1:])

    def decode(self, batch: int, context: int, repeats: int) -> float:
        # The sequences share their context's full blocks through the prefix cache, so setting a batch up costs
        # one prompt's prefill; each step still reads every sequence's whole context.
        shared = self._tokens(context - 1)
        first = self._run(shared + [4], repeats + 4)
        while self.engine.sequences[first].num_computed_tokens < context:
            self.engine.step()
        rids = [first] + [self._run(shared + [5 + i % self.vocab], repeats + 4) for i in range(batch - 1)]
        while any(self.engine.sequences[r].num_computed_tokens < context for r in rids):
            self.engine.step()
        self.engine.step()  # the first decode step after the prompts warms up their workspace
        seconds = _median_time(self.engine.step, repeats)
        self._drain()
        return seconds


def profiling_engine(model: str, loaded, max_context: int):
    """An engine of `model` (loaded) as the profile steps it: no chunking, a pool for the largest batch."""
    from pdrt.engine import EngineConfig, LLMEngine
    from pdrt.engine.kv_pool import KVLayout

    layout = KVLayout.for_model(loaded.model.config, BLOCK_SIZE, loaded.model.dtype)
    needed = MAX_BATCH * (max(DECODE_CONTEXTS) + 2 * BLOCK_SIZE) * layout.bytes_per_block // BLOCK_SIZE
    return LLMEngine(EngineConfig(model=model, kv_cache_memory_bytes=min(MAX_POOL_BYTES, needed),
                                  block_size=BLOCK_SIZE, max_num_seqs=MAX_BATCH, speculate="off",
                                  max_num_batched_tokens=1 << 16, max_prefill_chunk_size=1 << 16,
                                  max_model_len=max_context), loaded)


def _measure_steps(bench: StepBench, max_len: int, repeats: int, capacity_tokens: int
                   ) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """One pass over the grid: (new tokens, cached tokens, s) of prompts, (batch, attention, s) of decode steps."""
    prefill, decode = [], []
    n = 16
    while n <= max_len - 2:
        prefill.append((n, 0, bench.prefill(n, 0, repeats)))
        n *= 2
    for cached in CACHED_PREFIXES:
        for new in (64, 256):
            if cached + new <= max_len - 2:
                prefill.append((new, cached, bench.prefill(new, cached, repeats)))
    for context in DECODE_CONTEXTS:
        if context + repeats + 4 > max_len:
            continue
        b = 1
        while b <= MAX_BATCH and b * (context + repeats + 4) <= capacity_tokens:
            decode.append((b, b * context, bench.decode(b, context, repeats)))
            b *= 2
    return prefill, decode


def _fastest(passes: list[list[tuple[int, int, float]]]) -> list[tuple[int, int, float]]:
    """Each point at its fastest pass (every pass measures the same points in the same order)."""
    return [(*points[0][:2], min(p[2] for p in points)) for points in zip(*passes, strict=True)]


def measure_profile(model: str, threads: list[int] | None = None, max_context: int = 2048,
                    repeats: int = REPEATS, log: Callable[[str], None] = lambda _: None, loaded=None) -> Profile:
    """Measure `model` (a checkpoint directory; `loaded`: it loaded already) on this machine; a few minutes for
    a 135M model on 2 cores."""
    import torch

    from pdrt.engine.model_loader import load_model

    cores = os.cpu_count() or 1
    loaded = loaded if loaded is not None else load_model(model)
    profile: Profile | None = None
    for t in threads or thread_counts(cores):
        torch.set_num_threads(t)
        engine = profiling_engine(model, loaded, max_context)
        layout = engine.pool.layout
        max_len = engine.max_model_len
        if profile is None:
            profile = Profile(Path(model).name, host_cpu(), cores, layout.bytes_per_block // layout.block_size,
                              max_len, loaded.num_params)
        bench = StepBench(engine)
        bench.prefill(16, 0, 1)  # the first forward passes of a process are slow
        passes = [_measure_steps(bench, max_len, repeats, engine.capacity_tokens) for _ in range(PASSES)]
        prefill, decode = _fastest([p for p, _ in passes]), _fastest([d for _, d in passes])
        profile.prefill[t], profile.decode[t] = prefill, decode
        log(f"threads {t}: prefill of {prefill[-1][0]} tokens {prefill[-1][2] * 1e3:.1f} ms, decode step of "
            f"{decode[-1][0]} at {decode[-1][1] // decode[-1][0]} tokens {decode[-1][2] * 1e3:.1f} ms")
    assert profile is not None
    return profile


def profile_model(model: str, threads: list[int] | None = None, max_context: int = 2048, serving: bool = True,
                  log: Callable[[str], None] = lambda _: None) -> Profile:
    """`pdrt profile`: the engine's step times, then (with `serving`) what a running node adds to them."""
    from pdrt.engine.model_loader import load_model

    loaded = load_model(model)
    profile = measure_profile(model, threads, max_context, log=log, loaded=loaded)
    if serving:
        from pdrt.planner.overheads import measure_overheads

        log("measuring a node of one prefill and two decode workers")
        profile.overheads = asdict(measure_overheads(model, profile, loaded))
    return profile


class SpeedProbe:
    """This host's speed now against a profile of it: a prompt and a decode step, timed as the profile timed
    them, over what its fits say. A shared host drifts by tens of percent within an hour; a prediction compared
    with a run it serves is fair only at the speed the host had then."""

    PROMPT = 1024
    BATCH, CONTEXT = 16, 256
    REPEATS = 5

    def __init__(self, model: str, profile: Profile, threads: int = 1, loaded=None) -> None:
        import torch

        from pdrt.engine.model_loader import load_model

        torch.set_num_threads(threads)
        self.costs, self.threads = profile.cost_model(), threads
        self.prompt = min(self.PROMPT, profile.max_model_len // 2)
        loaded = loaded if loaded is not None else load_model(model)
        self.bench = StepBench(profiling_engine(model, loaded, profile.max_model_len))
        self.bench.prefill(16, 0, 1)  # the first forward passes of a process are slow

    def factors(self) -> tuple[float, float]:
        """(prefill, decode): how many times as long as the profile says a prompt and a decode step take now."""
        prefill = self.bench.prefill(self.prompt, 0, self.REPEATS) / self.costs.prefill_s(self.prompt, 0, self.threads)
        decode = (self.bench.decode(self.BATCH, self.CONTEXT, self.REPEATS)
                  / self.costs.decode_step_s(self.BATCH, self.BATCH * self.CONTEXT, self.threads))
        return prefill, decode
