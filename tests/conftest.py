"""Shared fixtures: tiny real checkpoints, prompts of mixed lengths and transformers' own greedy outputs."""

import inspect
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdrt.engine import EngineConfig, LLMEngine
from pdrt.engine.model_loader import LoadedModel, load_model
from pdrt.testing.tiny_model import build_tiny_model

PROMPT_LENGTHS = [1, 2, 5, 9, 16, 17, 31, 33, 64, 100, 127, 200, 256, 401, 513, 700, 1000, 1100]
MAX_NEW_TOKENS = 12

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch=arch, seed=i)
            for i, arch in enumerate(("llama", "qwen2", "mistral"))}


@pytest.fixture(scope="session")
def loaded_models(model_dirs: dict[str, Path]) -> dict[str, LoadedModel]:
    return {arch: load_model(str(path)) for arch, path in model_dirs.items()}


@pytest.fixture(scope="session")
def tokenizer(model_dirs: dict[str, Path]):
    return AutoTokenizer.from_pretrained(model_dirs["llama"])


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Prompts of 1 to 1100 tokens cut from text the tokenizer was not trained on."""
    import difflib
    import logging

    ids = tokenizer(inspect.getsource(difflib) + inspect.getsource(logging))["input_ids"]
    return [ids[i * 37 : i * 37 + n] for i, n in enumerate(PROMPT_LENGTHS)]


class Reference:
    """transformers' `generate(do_sample=False)` on the same checkpoint, with the stock SDPA attention."""

    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        self.cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False)
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]


@pytest.fixture(scope="session")
def references(model_dirs: dict[str, Path]) -> dict[str, Reference]:
    return {arch: Reference(path) for arch, path in model_dirs.items()}


@pytest.fixture
def make_engine(loaded_models: dict[str, LoadedModel]):
    """An engine over an already loaded tiny model; keyword arguments override the config."""

    def make(arch: str = "llama", **overrides) -> LLMEngine:
        loaded = loaded_models[arch]
        settings = dict(model=str(loaded.model.name_or_path), num_blocks=512)
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings), loaded=loaded)

    return make


@pytest.fixture
def client(node):
    """A raw native-protocol client of the module's `node` (a running `pdrt up`)."""
    from tests.system_client import RawClient

    c = RawClient(node.address)
    yield c
    c.close()
