"""pdrt on one GPU, checked in minutes: equality, CUDA IPC, a node both ways, decode speed. Run by gpu_check.sh.

(a) SmolLM2 in float32 on CUDA, greedy, against transformers' `generate` on the same GPU, for prompts of
    mixed lengths (one over 600 tokens); in bfloat16, where pdrt's first token differs from float32
    transformers' and the top-2 logit margin of transformers there (a margin near zero is a tie that
    rounding decides, not a bug).
(b) CUDA IPC: this process pulls a 2048-token SmolLM2 prompt's KV (bf16) from a second process's pool,
    against a device-to-device `copy_` of the same bytes; the same pull over TCP on loopback (pinned
    staging); and a handoff's pull against the prefill of 2048 tokens.
(c) `pdrt up` on this GPU: a prefill and a decode worker sharing it (CUDA IPC handoff), then a colocated
    worker; the same greedy answers through the Python client from both.
(d) Decode tokens/s of the engine against transformers' `generate` at batch 1 and 64, on a random model
    of Llama-3.2-1B's shape in bf16.

One line per figure; the last line is
`gpu equal=E/T ipc_vs_d2d=X handoff_vs_prefill_2048=Y decode_b64_vs_hf=Z`.
"""

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from pdrt.client import AsyncClient
from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.models.fetch import default_model_dir
from pdrt.testing.node import Node
from pdrt.testing.prompts import random_prompts
from pdrt.transport import make_puller
from pdrt.transport.auto import AutoPuller
from pdrt.wire import KVSourceDescriptor

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain paged attention in two sentences.", "List three prime numbers."]
LONG_TEXT = " ".join(f"Sentence {i} of a long document about the history of computing." for i in range(70))
SHAPE_2048 = (30, 2, 256, 16, 3, 64)  # SmolLM2's KV layout, a pool of 256 blocks; a 2048-token prompt is 128
MAX_NEW = 48
results: dict[str, float | str] = {}


def say(line: str) -> None:
    print(line, flush=True)


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


def check_equality(model_dir: str) -> tuple[int, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS] + [chat_ids(tokenizer, f"Summarise: {LONG_TEXT}")]
    say(f"(a) prompts of {', '.join(str(len(p)) for p in prompts)} tokens")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").cuda()
    expected = []
    for ids in prompts:
        t = torch.tensor([ids], device="cuda")
        out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_NEW, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    engine = LLMEngine(EngineConfig(model=model_dir, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 30))
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    equal = sum(g == e for g, e in zip(got, expected, strict=True))
    say(f"(a) float32 on CUDA: {equal}/{len(prompts)} greedy outputs equal to transformers' generate")
    del engine
    bf16 = LLMEngine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 30))
    for ids, exp, out in zip(prompts, expected, bf16.generate(prompts, SamplingParams(temperature=0,
                                                                                      max_tokens=MAX_NEW)),
                             strict=True):
        first = next((i for i, (a, b) in enumerate(zip(out, exp, strict=False)) if a != b), None)
        if first is None:
            say(f"(a) bfloat16, prompt of {len(ids)}: equal to float32 transformers for {len(exp)} tokens")
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + exp[:first]], device="cuda")).logits[0, -1].float()
        top2 = logits.topk(2).values
        say(f"(a) bfloat16, prompt of {len(ids)}: first divergence at output token {first}, where float32's "
            f"top-2 logit margin is {float(top2[0] - top2[1]):.4f}")
    del bf16, hf
    torch.cuda.empty_cache()
    return equal, len(prompts)


PRODUCER = f"""
import sys, msgspec, torch
from pdrt.transport import TransferBackend, make_source
src = make_source(TransferBackend.AUTO, "gpu-check-prefill", "127.0.0.1", device="cuda")
pool = src.allocate({SHAPE_2048}, torch.bfloat16)
pool.copy_(torch.randn(pool.shape, dtype=torch.bfloat16, device="cuda"))
torch.cuda.synchronize()
src.export("r", list(range(128)), 1e12)
print(msgspec.msgpack.encode(src.descriptor).hex(), flush=True)
sys.stdin.read()
"""


def median_time(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def check_ipc(model_dir: str) -> tuple[float, float]:
    child = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        descriptor = msgspec.msgpack.decode(bytes.fromhex(child.stdout.readline().decode().strip()),
                                            type=KVSourceDescriptor)
        pool = torch.zeros(SHAPE_2048, dtype=torch.bfloat16, device="cuda")
        puller = make_puller(pool)
        src_ids, dst_ids = list(range(0, 128)), list(range(128, 256))
        ipc_s = median_time(lambda: puller.pull(descriptor, "r", src_ids, dst_ids, time.monotonic() + 60, 10.0))
        a, b = torch.empty_like(pool[:, :, :128]), torch.empty_like(pool[:, :, :128])
        d2d_s = median_time(lambda: b.copy_(a))
        num_bytes = a.numel() * a.element_size()
        say(f"(b) CUDA IPC pull of a 2048-token prompt's KV ({num_bytes / 1e6:.0f} MB): {ipc_s * 1e3:.3f} ms, "
            f"{num_bytes / ipc_s / 1e9:.1f} GB/s; device-to-device copy_: {d2d_s * 1e3:.3f} ms, "
            f"{num_bytes / d2d_s / 1e9:.1f} GB/s")
        by_ipc = pool[:, :, 128:].clone()
        pool[:, :, 128:].zero_()
        remote = AutoPuller(pool, host_id="another host")  # over TCP on loopback, through pinned memory
        tcp_s = median_time(lambda: remote.pull(descriptor, "r", src_ids, dst_ids, time.monotonic() + 60, 10.0),
                            repeats=5)
        remote.close()
        same = torch.equal(pool[:, :, 128:], by_ipc)
        say(f"(b) the same pull over TCP on loopback (GPU to pinned host to GPU): {tcp_s * 1e3:.2f} ms, "
            f"{num_bytes / tcp_s / 1e9:.2f} GB/s; the same bytes as by CUDA IPC: {same}")
        engine = LLMEngine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16",
                                        kv_cache_memory_bytes=1 << 30, speculate="off"))
        prompt = random_prompts(1, 2040, engine.vocab_size, seed=3)[0]  # and its first token: within 2048

        def prefill() -> None:
            engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))

        prefill_s = median_time(prefill, repeats=5)
        say(f"(b) prefill of {len(prompt)} tokens: {prefill_s * 1e3:.2f} ms; a 2048-token pull: {ipc_s * 1e3:.3f} ms")
        puller.close()
        return d2d_s / ipc_s, ipc_s / prefill_s
    finally:
        child.stdin.close()
        child.wait(timeout=60)


async def answers(address: str, tokenizer) -> list[list[int]]:
    async with AsyncClient(address, timeout_s=120) as client:
        outs = await asyncio.gather(*(client.generate(token_ids=chat_ids(tokenizer, q),
                                                      params=SamplingParams(temperature=0, max_tokens=MAX_NEW))
                                      for q in QUESTIONS))
    return [list(o.token_ids) for o in outs]


def check_nodes(model_dir: str) -> tuple[int, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    got = {}
    for mode in ("disaggregated", "colocated"):
        with Node(workdir / mode, model_dir, mode=mode, transfer="auto",
                  engine={"device": "cuda", "kv_cache_bytes": 0, "gpus": "0"}, ready_timeout_s=300) as node:
            got[mode] = asyncio.run(answers(node.address, tokenizer))
        say(f"(c) pdrt up {mode} on the GPU answered {len(got[mode])} questions")
    equal = sum(a == b for a, b in zip(got["disaggregated"], got["colocated"], strict=True))
    say(f"(c) disaggregated (CUDA IPC) and colocated: {equal}/{len(QUESTIONS)} answers equal")
    return equal, len(QUESTIONS)


def check_decode() -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdrt.testing.tiny_model import train_tokenizer

    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-1b-"))
    config = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(workdir)
    train_tokenizer().save_pretrained(workdir)
    hf = AutoModelForCausalLM.from_pretrained(workdir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    engine = LLMEngine(EngineConfig(model=str(workdir), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=0,
                                    speculate="off", max_num_seqs=64))
    ratio = 0.0
    for batch in (1, 64):
        prompts = random_prompts(batch, 128, 1000, seed=batch)
        new = 128
        started = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        ours = batch * new / (time.perf_counter() - started)
        ids = torch.tensor(prompts, device="cuda")
        started = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False)
        theirs = batch * new / (time.perf_counter() - started)
        ratio = ours / theirs
        say(f"(d) Llama-3.2-1B shape, bf16, batch {batch}: pdrt {ours:.0f} tok/s, transformers generate "
            f"{theirs:.0f} tok/s: {ratio:.2f}x (prefill included in both)")
    return ratio


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device")
    say(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    model_dir = str(default_model_dir())
    equal, total = check_equality(model_dir)
    ipc_vs_d2d, handoff = check_ipc(model_dir)
    torch.cuda.empty_cache()  # the nodes' workers size their pools from what is free
    node_equal, node_total = check_nodes(model_dir)
    decode = check_decode()
    say(f"gpu equal={equal + node_equal}/{total + node_total} ipc_vs_d2d={ipc_vs_d2d:.2f} "
        f"handoff_vs_prefill_2048={handoff:.3f} decode_b64_vs_hf={decode:.2f}")


if __name__ == "__main__":
    main()
