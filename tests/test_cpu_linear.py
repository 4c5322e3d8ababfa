"""Linear layers on oneDNN-prepacked weights: the same products as torch's, on every linear of a model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdrt.engine.cpu_linear import PackedLinear, can_pack, pack_linears
from pdrt.engine.model_loader import load_model

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


def test_every_linear_of_a_cpu_float32_model_is_packed_and_its_logits_stay(model_dirs):
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], attn_implementation="sdpa").eval()
    num_linears = sum(type(m) is torch.nn.Linear for m in reference.modules())
    packed = load_model(str(model_dirs["qwen2"])).model  # qwen2: attention projections with bias
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == num_linears
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    packed.config._attn_implementation = "sdpa"  # the stock attention, so that only the linears differ
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_pdrt_cpu_kernels_0_or_another_dtype_leaves_the_model_alone(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    monkeypatch.setenv("PDRT_CPU_KERNELS", "0")
    assert not can_pack(model) and pack_linears(model) == 0
    monkeypatch.delenv("PDRT_CPU_KERNELS")
    assert pack_linears(model.to(torch.float64)) == 0
    assert pack_linears(model.to(torch.float32)) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "PackedLinear"]
