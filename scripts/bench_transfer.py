"""KV transfer: pull bandwidth against memcpy, and handoff latency against prefill time, in one run.

(a) Bandwidth. A source process (spawned) holds an shm and a TCP source in
    SmolLM2-135M's KV layout (30 layers, 3 KV heads, head_dim 64, float32,
    block size 16) and exports the 128 blocks of a 2048-token prompt (~94 MB,
    in four runs of a 256-block pool). This process pulls them into other
    block ids of its own pool through each backend (TCP also under the
    cluster key, CURVE, as a node runs it), and copies the same bytes
    between two contiguous tensors (`dst.copy_(src)`, the memcpy bound).
(b) Handoff. This process prefills 512- and 2048-token prompts with an
    LLMEngine whose pool lives in an shm source; a decode process (spawned)
    with its own pool of the same layout pulls the prompt's blocks on
    request and acknowledges. Handoff time runs from the prefill output to
    the acknowledgement, and is compared with the prefill's own time.

Every process uses one torch thread (the machine has two cores). Each figure
is a median: of repetitions lasting at least a second (and at least five)
for bandwidth, of --repeats prompts for the handoff. The last line is
`transfer shm_vs_memcpy=X tcp_vs_memcpy=Y tcp_key_vs_memcpy=K handoff_vs_prefill_2048=Z`.
"""

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from pdrt.actors.cluster_key import ClusterKey
from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.engine.model_loader import load_model
from pdrt.errors import TransferError
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.prompts import random_prompts
from pdrt.testing.tiny_model import build_tiny_model
from pdrt.transport import KVPuller, TransferBackend, make_puller, make_source
from pdrt.transport.copy import coalesce
from pdrt.transport.shm import remove_segments
from pdrt.wire import KVSourceDescriptor

# SmolLM2-135M's KV layout, a 256-block pool, and a 2048-token prompt's 128 blocks in four runs.
SMOLLM2_SHAPE = (30, 2, 256, 16, 3, 64)
SRC_IDS = [*range(0, 32), *range(64, 96), *range(128, 160), *range(192, 224)]
DST_IDS = list(range(100, 228))
MIN_SECONDS, MIN_REPEATS = 1.0, 5
LEASE_S = 30.0
HANDOFF_LENGTHS = (512, 2048)


def pattern(shape: tuple[int, ...], backend: int) -> torch.Tensor:
    """Deterministic pool contents, different per backend, so a pull can be checked exactly."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + backend


def median_seconds(run: Callable[[], None]) -> float:
    """Median time of `run`, repeated for at least MIN_SECONDS and MIN_REPEATS times."""
    times: list[float] = []
    while sum(times) < MIN_SECONDS or len(times) < MIN_REPEATS:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- (a) bandwidth ------------------------------------------------------------


def serve_sources(conn: Connection, run_id: str, key: str) -> None:
    """The source process: both backends' pools, and TCP's under the cluster key, filled and exported, until told
    to stop."""
    torch.set_num_threads(1)
    sources = []
    for name, backend, source_key in (("shm", TransferBackend.SHM, None), ("tcp", TransferBackend.TCP, None),
                                      ("tcp+key", TransferBackend.TCP, ClusterKey.parse(key))):
        source = make_source(backend, f"{run_id}-prefill-{name.replace('+', '-')}", "127.0.0.1", source_key)
        source.allocate(SMOLLM2_SHAPE, torch.float32).copy_(pattern(SMOLLM2_SHAPE, backend))
        source.export("bench", SRC_IDS, time.monotonic() + 3600)
        sources.append((name, source))
    conn.send([(name, source.descriptor) for name, source in sources])
    conn.recv()
    for _, source in sources:
        source.close()


def bench_bandwidth(ctx: mp.context.SpawnContext, run_id: str) -> dict[str, float]:
    """GB/s of memcpy, shm pull and TCP pull of one 2048-token prompt's KV."""
    parent, child = ctx.Pipe()
    key = ClusterKey.generate()
    proc = ctx.Process(target=serve_sources, args=(child, run_id, key.text), daemon=True)
    proc.start()
    try:
        descriptors: list[tuple[str, KVSourceDescriptor]] = parent.recv()
        dst = torch.zeros(SMOLLM2_SHAPE)
        pullers = {False: make_puller(dst), True: make_puller(dst, "decode-0", key)}
        n = len(SRC_IDS)
        num_bytes = dst[:, :, :n].numel() * dst.element_size()
        src_flat, dst_flat = torch.randn(num_bytes // 4), torch.zeros(num_bytes // 4)
        seconds = {"memcpy": median_seconds(lambda: dst_flat.copy_(src_flat))}
        for name, descriptor in descriptors:
            puller = pullers[name.endswith("+key")]

            def pull(d: KVSourceDescriptor = descriptor, puller: KVPuller = puller) -> None:
                puller.pull(d, "bench", SRC_IDS, DST_IDS, time.monotonic() + LEASE_S, 30.0)

            pull()  # maps the segment, connects the socket
            expected = pattern(SMOLLM2_SHAPE, descriptor.backend)[:, :, SRC_IDS]
            if not torch.equal(dst[:, :, DST_IDS], expected):
                raise SystemExit(f"{name} pull copied the wrong bytes")
            seconds[name] = median_seconds(pull)
        for puller in pullers.values():
            puller.close()
    finally:
        parent.send("stop")
        proc.join(10)
    gbps = {name: num_bytes / s / 1e9 for name, s in seconds.items()}
    print(f"\n(a) pull of a 2048-token prompt's KV: {n} blocks, {num_bytes / 1e6:.1f} MB, "
          f"SmolLM2 layout, {len(coalesce(SRC_IDS, DST_IDS))} runs")
    print(f"{'path':<8}{'ms':>9}{'GB/s':>8}{'vs memcpy':>11}")
    for name, s in seconds.items():
        print(f"{name:<8}{s * 1e3:>9.2f}{gbps[name]:>8.2f}{gbps[name] / gbps['memcpy']:>11.3f}")
    return {name: gbps[name] / gbps["memcpy"] for name in ("shm", "tcp", "tcp+key")}


# -- (b) handoff --------------------------------------------------------------


def decode_side(conn: Connection, descriptor: KVSourceDescriptor) -> None:
    """The decode process: a pool like the source's; pulls each handoff it is sent and acknowledges it."""
    torch.set_num_threads(1)
    shape = (descriptor.num_layers, 2, descriptor.num_blocks, descriptor.block_size, descriptor.num_kv_heads,
             descriptor.head_dim)
    pool = torch.zeros(shape, dtype=getattr(torch, descriptor.dtype))
    puller = make_puller(pool)
    conn.send("ready")
    while (handoff := conn.recv()) is not None:
        request_id, block_ids, lease_expires_at = handoff
        try:
            puller.pull(descriptor, request_id, block_ids, list(range(len(block_ids))), lease_expires_at, 30.0)
            conn.send(None)
        except TransferError as exc:
            conn.send(str(exc))
    puller.close()


def model_path(tmp: str) -> tuple[str, str]:
    if is_fetched():
        return "SmolLM2-135M-Instruct", str(default_model_dir())
    print("note: SmolLM2 is not fetched (pdrt model fetch); the handoff is measured on a tiny random model")
    return "tiny", str(build_tiny_model(Path(tmp) / "tiny"))


def bench_handoff(ctx: mp.context.SpawnContext, run_id: str, repeats: int) -> dict[int, float]:
    """Median handoff / prefill time per prompt length, through an shm source feeding an engine."""
    with tempfile.TemporaryDirectory() as tmp:
        name, path = model_path(tmp)
        loaded = load_model(path)
    source = make_source(TransferBackend.SHM, f"{run_id}-prefill-engine", "")
    config = EngineConfig(model=path, num_blocks=160, max_num_batched_tokens=2048, enable_prefix_caching=False,
                          num_threads=1)
    engine = LLMEngine(config, loaded=loaded, kv_allocator=source.allocate)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, source.descriptor), daemon=True)
    proc.start()
    parent.recv()
    vocab = int(loaded.model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def handoff(request_id: str, prompt: list[int]) -> tuple[float, float]:
        engine.add_prefill(request_id, prompt, params)
        start = time.perf_counter()
        block_ids = None
        while block_ids is None:
            block_ids = next((o.kv_block_ids for o in engine.step() if o.request_id == request_id), None)
        prefilled = time.perf_counter()
        lease_expires_at = time.monotonic() + LEASE_S
        source.export(request_id, block_ids, lease_expires_at)
        parent.send((request_id, block_ids, lease_expires_at))
        error = parent.recv()
        acked = time.perf_counter()
        source.withdraw(request_id)
        engine.release(request_id)
        if error is not None:
            raise SystemExit(f"handoff of {request_id} failed: {error}")
        return prefilled - start, acked - prefilled

    rows: dict[int, tuple[float, float]] = {}
    try:
        handoff("warmup", random_prompts(1, 512, vocab, seed=0)[0])  # maps the segment on the decode side
        for length in HANDOFF_LENGTHS:
            runs = [handoff(f"{length}-{i}", p) for i, p in enumerate(random_prompts(repeats, length, vocab, seed=1))]
            rows[length] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    finally:
        parent.send(None)
        proc.join(10)
        source.close()
    print(f"\n(b) handoff through shm, {name}, median of {repeats}")
    print(f"{'prompt':<8}{'prefill ms':>12}{'handoff ms':>12}{'handoff/prefill':>17}")
    for length, (prefill_s, handoff_s) in rows.items():
        print(f"{length:<8}{prefill_s * 1e3:>12.1f}{handoff_s * 1e3:>12.2f}{handoff_s / prefill_s:>17.4f}")
    return {length: handoff_s / prefill_s for length, (prefill_s, handoff_s) in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="prompts per length in the handoff measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ctx = mp.get_context("spawn")
    run_id = f"pdrt-bench-{uuid.uuid4().hex[:8]}"
    try:
        bandwidth = bench_bandwidth(ctx, run_id)
        handoff = bench_handoff(ctx, run_id, args.repeats)
    finally:
        remove_segments(run_id)
    print(f"transfer shm_vs_memcpy={bandwidth['shm']:.3f} tcp_vs_memcpy={bandwidth['tcp']:.3f} "
          f"tcp_key_vs_memcpy={bandwidth['tcp+key']:.3f} handoff_vs_prefill_2048={handoff[2048]:.3f}")


if __name__ == "__main__":
    main()
