"""pdrt's forward pass (pdrt/engine/decoder.py) against transformers' own, on the tiny checkpoints of every
supported architecture: the same logits, with the projections fused and the original weights gone."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdrt.engine.model_loader import load_model
from tests.conftest import prompt_logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_decoders_logits_are_those_of_transformers(model_dirs, arch):
    reference = AutoModelForCausalLM.from_pretrained(model_dirs[arch], attn_implementation="sdpa").eval()
    ids = list(range(3, 90))
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    logits = prompt_logits(load_model(str(model_dirs[arch])), ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_fused_projections_replace_the_separate_ones(model_dirs):
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"]).eval()
    loaded = load_model(str(model_dirs["qwen2"]))
    attn, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
    assert not any(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj"))
    assert not any(hasattr(mlp, name) for name in ("gate_proj", "up_proj"))
    ref_attn = reference.model.layers[0].self_attn
    assert torch.equal(attn.qkv_proj.bias, torch.cat([ref_attn.q_proj.bias, ref_attn.k_proj.bias,
                                                      ref_attn.v_proj.bias]))
    assert sum(p.numel() for p in loaded.model.parameters()) == sum(p.numel() for p in reference.parameters())


def test_a_draft_model_keeps_transformers_forward(model_dirs):
    """A draft model keeps its cache in transformers (pdrt/engine/proposers.py): nothing is fused."""
    loaded = load_model(str(model_dirs["llama"]), attention="sdpa")
    assert loaded.decoder is None and hasattr(loaded.model.model.layers[0].self_attn, "q_proj")
