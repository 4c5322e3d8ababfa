"""Loading checkpoints: supported architectures, clear errors for the rest."""

import pytest
from transformers import AutoConfig

from pdrt.engine import EngineConfig, LLMEngine
from pdrt.engine.model_loader import load_model
from pdrt.errors import ModelLoadError, UnsupportedModelError
from pdrt.testing.tiny_model import build_tiny_model


def test_unknown_architecture_is_a_typed_error(tmp_path):
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_missing_checkpoint_is_a_typed_error(tmp_path):
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "weights.bin"))


def test_sliding_window_caps_the_context(tmp_path):
    path = build_tiny_model(tmp_path / "m", arch="mistral")
    config = AutoConfig.from_pretrained(path)
    config.sliding_window = 256
    config.save_pretrained(path)
    assert load_model(str(path)).context_length == 256


def test_loaded_model_reports_tokenizer_and_eos(model_dirs):
    loaded = load_model(str(model_dirs["qwen2"]))
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template
    assert loaded.eos_token_ids == [loaded.tokenizer.eos_token_id]
    assert loaded.model.config._attn_implementation == "pdrt_paged"
    assert loaded.context_length == 4096
