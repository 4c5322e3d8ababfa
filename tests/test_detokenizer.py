"""IncrementalDetokenizer: whole UTF-8 characters in every delta, and stop strings that span tokens."""

import pytest

from pdrt.engine.detokenizer import IncrementalDetokenizer

MULTI_BYTE_TEXT = "héllo wörld → 🚀 ok ünïcode"
CODE_TEXT = "result = value if stop here else other"


def feed(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> tuple[int, str] | None:
    """Add tokens as the engine does; return (index of the token that completed a stop string, the string)."""
    for i, token_id in enumerate(token_ids):
        stop = detokenizer.find_stop(len(detokenizer.add(token_id)))
        if stop is not None:
            return i, stop
    return None


@pytest.mark.parametrize("context", ["", "x = "], ids=["no-context", "short-context"])
def test_deltas_of_multi_byte_characters_are_whole_and_add_up_to_the_text(tokenizer, context):
    ids = tokenizer(MULTI_BYTE_TEXT)["input_ids"]
    # The byte-level tokenizer splits the accented letters and symbols into
    # byte tokens that do not decode alone: the case under test.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer(context)["input_ids"] if context else [])
    deltas = [detokenizer.add(t) for t in ids]
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTI_BYTE_TEXT
    assert detokenizer.text == MULTI_BYTE_TEXT


def test_find_stop_cuts_the_text_before_the_stop_string_and_returns_it(tokenizer):
    ids = tokenizer(CODE_TEXT)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[" value"])
    found = feed(detokenizer, ids)
    assert found is not None and found[1] == " value"
    assert tokenizer.decode(ids[: found[0] + 1]).endswith(" value")
    assert detokenizer.text == "result ="


def test_find_stop_finds_a_stop_string_split_across_several_adds(tokenizer):
    ids = tokenizer(CODE_TEXT)["input_ids"]
    pieces = [tokenizer.decode([t]) for t in ids]
    # "stop here" is spread over the tokens " st", "o", "p", " ", "he", "re".
    assert not any("stop here" in p for p in pieces)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer("x = ")["input_ids"], stop=["stop here"])
    found = feed(detokenizer, ids)
    assert found is not None
    index, stop = found
    assert stop == "stop here"
    assert "stop here" in tokenizer.decode(ids[: index + 1])
    assert "stop here" not in tokenizer.decode(ids[:index])
    assert detokenizer.text == "result = value if "


def test_find_stop_picks_the_stop_string_that_starts_first(tokenizer):
    ids = tokenizer(CODE_TEXT)["input_ids"]
    # Both complete with the token " other"; "e ot" starts earlier though listed later.
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["ther", "e ot", "never there"])
    assert feed(detokenizer, ids) == (len(ids) - 1, "e ot")
    assert detokenizer.text == "result = value if stop here els"


def test_find_stop_picks_the_stop_string_that_completes_first(tokenizer):
    ids = tokenizer(CODE_TEXT)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["else", "if"])
    index, stop = feed(detokenizer, ids)
    assert stop == "if"
    assert tokenizer.decode(ids[: index + 1]).endswith(" if")
    assert detokenizer.text == "result = value "


def test_find_stop_without_new_text_or_without_stop_strings_finds_nothing(tokenizer):
    ids = tokenizer(CODE_TEXT)["input_ids"]
    assert feed(IncrementalDetokenizer(tokenizer, [], stop=["nowhere"]), ids) is None
    plain = IncrementalDetokenizer(tokenizer, [])
    assert feed(plain, ids) is None
    assert plain.text == CODE_TEXT
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["result"])
    for t in ids[:2]:
        detokenizer.add(t)
    assert detokenizer.find_stop(0) is None
    assert detokenizer.text == "result"
