"""The default model, SmolLM2-135M-Instruct: slow, and only where `pdrt model fetch` has run."""

import inspect
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
from pdrt.models.fetch import default_gguf_path, default_model_dir, is_fetched

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not is_fetched(), reason="run `pdrt model fetch` first"),
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into German, French and Spanish.",
]


@pytest.fixture(scope="module")
def chats() -> list[list[int]]:
    engine_dir = default_model_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    return_dict=True)["input_ids"] for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(chats) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), attn_implementation="sdpa").eval()
    out = []
    for ids in chats:
        t = torch.tensor([ids])
        gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=48, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_smollm2_greedy_equals_generate(chats, expected, source):
    path = default_model_dir() if source == "safetensors" else default_gguf_path()
    engine = LLMEngine(EngineConfig(model=str(path), max_prefill_chunk_size=16, num_blocks=256))
    got = engine.generate(chats, SamplingParams(temperature=0, max_tokens=48))
    assert got == expected
    answer = engine.tokenizer.decode(got[0], skip_special_tokens=True)
    assert "Paris" in answer


def test_smollm2_speculation_on_a_grounded_prompt_keeps_proposals_and_equals_generate():
    from transformers import AutoTokenizer

    source = inspect.getsource(textwrap.dedent)
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    ids = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly.\n\n```python\n"
                                    f"{source}```"}], add_generation_prompt=True, return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), attn_implementation="sdpa").eval()
    t = torch.tensor([ids])
    expected = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=96, do_sample=False)
    engine = LLMEngine(EngineConfig(model=str(default_model_dir()), num_blocks=256))
    assert engine.generate([ids], SamplingParams(temperature=0, max_tokens=96)) == [expected[0, len(ids):].tolist()]
    spec = engine.speculator
    assert spec.num_accepted > 0.5 * spec.num_proposed and spec.num_decode_tokens > 2 * spec.num_decode_seq_steps
