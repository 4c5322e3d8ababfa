"""Incremental tokenization of drafts: stable prefixes never need a rollback on appends; submit is exact."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.typeahead.draft_tokenizer import DraftTokenizer, common_prefix_len

ALPHABET = st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs"), exclude_characters="\u2063") \
    | st.sampled_from(list(" \n\t.,;:!?'\"()-_=+*/#é漢🙂"))
TEXT = st.text(ALPHABET, min_size=0, max_size=400)


@pytest.fixture(scope="module")
def tokenizers(model_dirs):
    found = {"tiny": AutoTokenizer.from_pretrained(model_dirs["llama"])}
    if is_fetched():
        found["smollm2"] = AutoTokenizer.from_pretrained(default_model_dir())
    return found


def splits(draw, text: str) -> list[str]:
    points = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces, last = [], 0
    for p in [*points, len(text)]:
        pieces.append(text[last:p])
        last = p
    return pieces


@st.composite
def typing(draw):
    text = draw(TEXT)
    return text, splits(draw, text)


@st.composite
def editing(draw):
    """Steps of ("append", text) and ("cut", n): typing with backspaces and rewritten tails."""
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            steps.append(("append", draw(TEXT)))
        else:
            steps.append(("cut", draw(st.integers(0, 40))))
    return steps


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
@pytest.mark.parametrize("chat", [True, False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=typing(), history=st.sampled_from([[], [{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": "Hello! How can I help?"}]]))
def test_stable_tokens_of_an_appended_text_are_a_prefix_of_its_final_tokens(tokenizers, name, chat, case, history):
    if name not in tokenizers:
        pytest.skip("SmolLM2 is not fetched")
    tokenizer = tokenizers[name]
    text, pieces = case
    draft = DraftTokenizer(tokenizer, history if chat else None)
    draft.text = text
    final = draft.final_ids()
    if chat:
        one_go = tokenizer.apply_chat_template([*history, {"role": "user", "content": text}],
                                               add_generation_prompt=True, return_dict=True)["input_ids"]
    else:
        one_go = tokenizer(text)["input_ids"]
    assert final == one_go
    draft.text = ""
    for piece in pieces:
        draft.text += piece
        stable = draft.stable_ids()
        assert final[: len(stable)] == stable, (draft.text, piece)


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=editing())
def test_after_edits_the_last_stable_prefix_survives_and_submit_gives_the_one_go_tokens(tokenizers, name, steps):
    if name not in tokenizers:
        pytest.skip("SmolLM2 is not fetched")
    tokenizer = tokenizers[name]
    draft = DraftTokenizer(tokenizer, [])
    prefilled: list[int] = []
    for kind, value in steps:
        draft.text = draft.text + value if kind == "append" else draft.text[: max(0, len(draft.text) - value)]
        stable = draft.stable_ids()
        prefilled = stable  # what a worker holds after rolling back to the common prefix and extending
    final = draft.final_ids()
    assert final == tokenizer.apply_chat_template([{"role": "user", "content": draft.text}],
                                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    assert common_prefix_len(prefilled, final) == len(prefilled)  # submit only appends to what was prefilled
