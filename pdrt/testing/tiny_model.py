"""A tiny random causal LM and a BPE tokenizer trained on local text, saved as a real checkpoint.

Tests and benchmarks need a model that loads through the same code as a real
one (a safetensors directory with config, tokenizer and chat template) but is
built without a network in seconds. The tokenizer is trained on the Python
standard library's own source text, which every machine has.
"""

import inspect
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHITECTURES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
}


def corpus_text() -> str:
    """Local, fixed training text: the source of a few standard-library modules."""
    import argparse
    import collections
    import email.message
    import json as json_module
    import textwrap

    return "\n".join(inspect.getsource(m) for m in (argparse, collections, email.message, json_module, textwrap))


def train_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: Path, arch: str = "llama", hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                     vocab_size: int = 1024, max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """Write a random model of `arch` with a trained tokenizer to `out_dir` and return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    spec = dict(ARCHITECTURES[arch])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        initializer_range=0.2, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "pdrt_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return out_dir


def build_wide_model(out_dir: Path, hidden_size: int = 384) -> Path:
    """A random Llama of 4 layers whose steps are arithmetic rather than Python, as a real model's are, while
    still a small model for pdrt's worker profiles: for benchmarks of how work is split across workers. At the
    default width it has 7.7 M parameters; at 768, 29 M, and a decode step of a few streams costs mostly the
    reading of its weights while each further stream adds a good part of that, as on a GPU."""
    return build_tiny_model(out_dir, hidden_size=hidden_size, num_layers=4, num_heads=hidden_size // 64,
                            num_kv_heads=hidden_size // 192, intermediate_size=3 * hidden_size)


def build_deep_twin(model_dir: Path, out_dir: Path, num_layers: int = 16) -> Path:
    """A model whose outputs equal `model_dir`'s exactly but whose steps cost more: its layers, then layers that
    add nothing to the residual stream (their output projections are zero). The smaller model is then a draft
    whose every greedy proposal the twin keeps, for tests of speculative decoding."""
    small = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = small.config.to_dict()
    config.update(num_hidden_layers=num_layers)
    config.pop("layer_types", None)
    twin = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    twin.load_state_dict(small.state_dict(), strict=False)
    for layer in twin.model.layers[small.config.num_hidden_layers:]:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    out_dir = Path(out_dir)
    twin.save_pretrained(out_dir)
    PreTrainedTokenizerFast.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir
