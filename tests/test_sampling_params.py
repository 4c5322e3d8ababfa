"""SamplingParams rejects every invalid field, whether built in Python or decoded from JSON."""

import msgspec
import pytest

from pdrt.engine import SamplingParams
from pdrt.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from pdrt.errors import InvalidSamplingParamsError

INVALID = {
    "negative temperature": {"temperature": -0.5},
    "temperature above 100": {"temperature": 100.5},
    "negative top_k": {"top_k": -1},
    "zero top_p": {"top_p": 0.0},
    "negative top_p": {"top_p": -0.1},
    "top_p above 1": {"top_p": 1.5},
    "negative seed": {"seed": -1},
    "seed of 2**63": {"seed": 2**63},
    "zero max_tokens": {"max_tokens": 0},
    "negative max_tokens": {"max_tokens": -3},
    "too many stop strings": {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]},
    "empty stop string": {"stop": ["ok", ""]},
    "too long stop string": {"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]},
    "negative stop token id": {"stop_token_ids": [2, -1]},
}

VALID_EDGES = {
    "greedy": {"temperature": 0.0},
    "hottest": {"temperature": 100.0},
    "top_p of 1": {"top_p": 1.0},
    "largest seed": {"seed": 2**63 - 1},
    "smallest seed": {"seed": 0},
    "one token": {"max_tokens": 1},
    "most stop strings, longest": {"stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS},
}


@pytest.mark.parametrize("fields", INVALID.values(), ids=INVALID.keys())
def test_an_invalid_field_is_rejected_on_construction(fields):
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields", INVALID.values(), ids=INVALID.keys())
def test_an_invalid_field_is_rejected_when_decoding_json(fields):
    with pytest.raises(InvalidSamplingParamsError):
        msgspec.json.decode(msgspec.json.encode(fields), type=SamplingParams)


def test_nan_temperature_and_top_p_are_rejected():
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(top_p=float("nan"))


@pytest.mark.parametrize("fields", VALID_EDGES.values(), ids=VALID_EDGES.keys())
def test_values_at_the_edges_are_accepted_and_survive_a_json_round_trip(fields):
    params = SamplingParams(**fields)
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
    for name, value in fields.items():
        assert getattr(params, name) == value


def test_unknown_fields_are_rejected():
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(b'{"temperature": 0.5, "best_of": 2}', type=SamplingParams)


def test_fields_of_the_wrong_type_are_rejected():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"top_k": "3"}', type=SamplingParams)
