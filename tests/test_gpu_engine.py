"""The engine on a GPU: the page tables FlashInfer reads (arithmetic, tested everywhere), and where torch sees a
CUDA device, greedy equality with transformers in float32 (SDPA) and FlashInfer's bfloat16 path against SDPA's."""

import pytest
import torch

from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.engine.kv_pool import KVLayout, KVPool
from pdrt.engine.paged_kernels import PagedKernels, page_table

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_page_tables_name_each_sequences_blocks_up_to_its_length():
    table = page_table([[7, 3, 9, 0], [4, 0, 0, 0], [5, 6, 0, 0]], [33, 16, 17], block_size=16)
    assert table.indptr == [0, 3, 4, 6]
    assert table.indices == [7, 3, 9, 4, 5, 6]  # padding past a sequence's length is never read
    assert table.last_page_len == [1, 16, 1]


def test_the_kernels_serve_only_half_precision_pools_on_cuda():
    pool = KVPool(KVLayout(2, 2, 8, 16, torch.float32), 4)
    assert PagedKernels.load(pool, num_heads=4) is None  # a CPU pool keeps its compiled kernel and SDPA


@pytest.mark.gpu
@cuda
def test_float32_on_cuda_equals_generate(model_dirs, references, prompts):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["llama"]), device="cuda", dtype="float32",
                                    num_blocks=512))
    assert engine.runner.kernels is None
    ref = references["llama"]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert outputs == [ref.greedy(p) for p in prompts]


@pytest.mark.gpu
@cuda
def test_flashinfer_in_bfloat16_agrees_with_sdpa_over_gathered_blocks(model_dirs, prompts):
    pytest.importorskip("flashinfer")
    config = EngineConfig(model=str(model_dirs["llama"]), device="cuda", dtype="bfloat16", num_blocks=512)
    kernels = LLMEngine(config)
    assert kernels.runner.kernels is not None
    gathered = LLMEngine(config)
    gathered.runner.kernels = None
    params = SamplingParams(temperature=0, max_tokens=12)
    a, b = kernels.generate(prompts, params), gathered.generate(prompts, params)
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= 0.8 * len(prompts)  # bf16 ties may round apart
