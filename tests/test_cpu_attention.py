"""The compiled decode-attention kernel against SDPA, and the engine on both decode-attention paths."""

import random
import sys

import pytest
import torch
import torch.nn.functional as F

from pdrt.engine import EngineConfig, LLMEngine, SamplingParams, cpu_attention
from pdrt.engine.cpu_linear import PackedLinear
from pdrt.engine.model_loader import load_model
from tests.conftest import MAX_NEW_TOKENS

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="no C compiler to build the kernel")


@pytest.fixture
def kernels_off(monkeypatch):
    """`cpu_attention.load()` as a process without the kernel sees it; the cache is restored afterwards."""
    monkeypatch.setenv("PDRT_CPU_KERNELS", "0")
    cpu_attention.load.cache_clear()
    yield
    monkeypatch.undo()
    cpu_attention.load.cache_clear()


def reference(query, k_blocks, v_blocks, tables, lengths, block_size, num_kv_heads):
    """Each sequence alone: its blocks gathered in order, cut to its length, SDPA with grouped heads."""
    out = torch.empty_like(query)
    head_dim = query.shape[2]
    for s, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        k = k_blocks[table].view(-1, num_kv_heads, head_dim)[:length].transpose(0, 1)
        v = v_blocks[table].view(-1, num_kv_heads, head_dim)[:length].transpose(0, 1)
        out[s] = F.scaled_dot_product_attention(query[s].unsqueeze(1), k, v, enable_gqa=True).squeeze(1)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (4, 4, 128), (8, 1, 80)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_sdpa_over_scattered_blocks_of_any_length(num_heads, num_kv_heads, head_dim, threads):
    rng = random.Random(num_heads * head_dim + threads)
    torch.manual_seed(rng.randrange(1 << 30))
    block_size, num_blocks = 16, 400
    # Inside a block, at its edge, across several; in all enough work for the kernel to use both threads.
    lengths = [1, 2, 15, 16, 17, 100, 333, 512, 4100]
    max_blocks = -(-max(lengths) // block_size)
    free = list(range(num_blocks))
    rng.shuffle(free)  # each sequence's blocks scattered over the pool, in no order
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    k_blocks = torch.randn(num_blocks, block_size * num_kv_heads * head_dim)
    v_blocks = torch.randn(num_blocks, block_size * num_kv_heads * head_dim)
    query = torch.randn(len(lengths), num_heads, head_dim)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_attention.load()(query, k_blocks, v_blocks, padded, torch.tensor(lengths), max(lengths),
                                   block_size, num_kv_heads, head_dim ** -0.5)
    finally:
        torch.set_num_threads(previous)
    expected = reference(query, k_blocks, v_blocks, tables, lengths, block_size, num_kv_heads)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_kernel_equals_sdpa_where_one_key_takes_nearly_all_the_weight():
    """Scores far apart, so most weights fall below e^-87, where the kernel's exp flushes to zero."""
    torch.manual_seed(0)
    block_size, num_blocks, num_kv_heads, head_dim = 16, 64, 2, 64
    lengths = [40, 700]
    tables = [list(range(0, 3)), list(range(3, 3 + 44))]
    padded = torch.tensor([t + [0] * (44 - len(t)) for t in tables])
    k_blocks = torch.randn(num_blocks, block_size * num_kv_heads * head_dim) * 30
    v_blocks = torch.randn(num_blocks, block_size * num_kv_heads * head_dim)
    query = torch.randn(2, 6, head_dim) * 30
    out = cpu_attention.load()(query, k_blocks, v_blocks, padded, torch.tensor(lengths), 700, block_size,
                               num_kv_heads, head_dim ** -0.5)
    expected = reference(query, k_blocks, v_blocks, tables, lengths, block_size, num_kv_heads)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_a_head_size_off_its_vector_width():
    assert not cpu_attention.supports(torch.device("cpu"), torch.float32, 8)
    query = torch.randn(1, 2, 8)
    blocks = torch.randn(4, 16 * 2 * 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_attention.load()(query, blocks, blocks, torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]), 3, 16, 2,
                             1.0)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_kernel_shares_the_openmp_runtime_torch_loaded():
    assert cpu_attention.load() is not None
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_engine_decodes_with_the_kernel_by_default(make_engine):
    assert make_engine().runner.decode_kernel is not None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_with_cpu_kernels_off_the_plain_torch_path_still_equals_generate(kernels_off, model_dirs, references, prompts,
                                                                          arch):
    loaded = load_model(str(model_dirs[arch]))  # torch's linear layers, not packed ones
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    engine = LLMEngine(EngineConfig(model="plain", num_blocks=512, max_prefill_chunk_size=128,
                                    max_num_batched_tokens=300), loaded=loaded)
    assert engine.runner.decode_kernel is None
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == references[arch].greedy(prompt), f"prompt of {len(prompt)} tokens"


def test_a_compiler_that_fails_leaves_the_gather_path(monkeypatch, tmp_path, make_engine, references, prompts):
    monkeypatch.setenv("CC", "false")  # exits 1 for --version and for the build alike
    monkeypatch.setenv("PDRT_CACHE_DIR", str(tmp_path))  # no binary cached from an earlier build
    cpu_attention.load.cache_clear()
    try:
        engine = make_engine()
        assert engine.runner.decode_kernel is None
        assert engine.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)) == \
            [references["llama"].greedy(p) for p in prompts[:4]]
    finally:
        monkeypatch.undo()
        cpu_attention.load.cache_clear()
