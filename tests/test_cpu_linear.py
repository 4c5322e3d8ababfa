"""Linear layers on oneDNN-prepacked weights: the same products as torch's, on every linear of a model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.engine.cpu_linear import PackedLinear, can_pack, pack_linears
from pdrt.engine.model_loader import load_model
from tests.conftest import MAX_NEW_TOKENS, prompt_logits

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (1, 33, 64), (512, 64)])
def test_packed_linear_computes_what_linear_does(bias, shape):
    torch.manual_seed(len(shape) * 100 + shape[0])
    linear = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    expected = linear(x)
    with torch.inference_mode():
        out = PackedLinear(linear)(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def packed_qwen2(model_dirs):
    """The tiny qwen2 model (attention projections with bias) with every linear packed, however small."""
    loaded = load_model(str(model_dirs["qwen2"]))
    assert pack_linears(loaded.model, min_weight=0) > 0
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    return loaded


def test_a_packed_models_logits_stay_those_of_transformers(packed_qwen2, model_dirs):
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], attn_implementation="sdpa").eval()
    ids = list(range(3, 40))
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prompt_logits(packed_qwen2, ids), expected, rtol=1e-4, atol=1e-4)


def test_an_engine_on_packed_linears_still_equals_generate(packed_qwen2, references, prompts):
    engine = LLMEngine(EngineConfig(model="packed", num_blocks=512, max_prefill_chunk_size=128), loaded=packed_qwen2)
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == references["qwen2"].greedy(prompt), f"prompt of {len(prompt)} tokens"


def test_small_weights_stay_with_torch():
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 64))
    assert pack_linears(model) == 1  # 131072 weights and 16384
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear"]


def test_pdrt_cpu_kernels_0_or_another_dtype_leaves_the_model_alone(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    monkeypatch.setenv("PDRT_CPU_KERNELS", "0")
    assert not can_pack(model) and pack_linears(model, min_weight=0) == 0
    monkeypatch.delenv("PDRT_CPU_KERNELS")
    assert pack_linears(model.to(torch.float64), min_weight=0) == 0
    assert pack_linears(model.to(torch.float32), min_weight=0) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "PackedLinear"]
