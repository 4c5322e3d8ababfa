"""Loading a transformers causal LM (safetensors directory or GGUF file) for the paged engine."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from pdrt.engine.attention import ATTENTION_NAME
from pdrt.engine.cpu_linear import pack_linears
from pdrt.engine.decoder import Decoder, fuse_projections
from pdrt.errors import ModelLoadError, UnsupportedModelError

# Architectures whose attention modules call the AttentionInterface with
# `layer_idx` set and no per-layer sliding window or cache tricks. Mistral and
# Qwen2 may declare a sliding window; `context_length` caps the context at it,
# where full attention and sliding-window attention agree.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any | None
    context_length: int
    eos_token_ids: list[int]
    num_params: int  # counted before packing: packed weights are not parameters
    decoder: Decoder | None = None  # pdrt's forward over the paged pool; None where transformers keeps the cache


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def _source(path: str) -> tuple[Path, dict[str, str]]:
    """The directory transformers reads and the extra arguments that name a GGUF file in it."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, {"gguf_file": p.name}
    if p.is_dir() and (p / "config.json").is_file():
        return p, {}
    raise ModelLoadError(f"{path} is neither a checkpoint directory with config.json nor a .gguf file")


def _context_length(config: Any) -> int:
    length = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        length = min(length, int(window))
    return length


def _eos_token_ids(model: PreTrainedModel) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def load_model(path: str, device: str = "cpu", dtype: str = "auto", attention: str = ATTENTION_NAME) -> LoadedModel:
    """Load weights, tokenizer and limits; raise a typed error for anything unusable. `attention` is pdrt's paged
    attention, or transformers' own for a model that keeps its cache in transformers (a draft model)."""
    source, extra = _source(path)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True, **extra)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config at {path}: {exc}") from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=attention, local_files_only=True, **extra
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the weights at {path}: {exc}") from exc
    model.to(torch_device).eval()
    num_params = sum(p.numel() for p in model.parameters())
    paged = attention == ATTENTION_NAME
    if paged:
        fuse_projections(model)  # before packing, which packs the fused weights
    pack_linears(model)  # float32 on the CPU: oneDNN on weights packed once (pdrt/engine/cpu_linear.py)
    decoder = Decoder(model) if paged else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **extra)
    except (OSError, ValueError):
        tokenizer = None  # token-id-only use is still possible
    return LoadedModel(model, tokenizer, _context_length(config), _eos_token_ids(model), num_params, decoder)


def load_tokenizer(path: str) -> tuple[Any, int, int]:
    """The tokenizer, context length and vocabulary size of a checkpoint, without its weights (for a gateway)."""
    source, extra = _source(path)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True, **extra)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **extra)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer at {path}: {exc}") from exc
    return tokenizer, _context_length(config), int(config.vocab_size)
