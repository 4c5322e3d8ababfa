"""The gateway's per-request text: incremental, UTF-8 safe, stop strings never leak into a stream."""

from pdrt.engine.outputs import RequestOutput
from pdrt.engine.sampling_params import SamplingParams
from pdrt.roles.gateway_request import GatewayRequest


def run(tokenizer, tokens: list[int], params: SamplingParams, stream: bool, per_step: int = 1):
    req = GatewayRequest.create(b"c", "r", [1, 2, 3], params, stream, deadline=1e9, tokenizer=tokenizer)
    frames = []
    for start in range(0, len(tokens), per_step):
        last = start + per_step >= len(tokens)
        out = RequestOutput("i", tokens[start:start + per_step], finished=last, finish_reason=2 if last else None)
        frame, finished = req.add(out)
        if frame is not None:
            frames.append(frame)
        if finished:
            break
    return frames


def test_streamed_text_adds_up_to_the_whole_text_and_the_decoded_tokens(tokenizer):
    tokens = tokenizer("def f(x):\n    return x * 2  # é ü 漢字")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=len(tokens))
    streamed = run(tokenizer, tokens, params, stream=True)
    whole = run(tokenizer, tokens, params, stream=False, per_step=3)
    assert len(whole) == 1 and whole[0].finished and whole[0].token_ids == tokens
    assert "".join(f.text for f in streamed) == whole[0].text == tokenizer.decode(tokens)
    assert [t for f in streamed for t in f.token_ids] == tokens
    assert streamed[-1].finish_reason == "length" and streamed[-1].usage.completion_tokens == len(tokens)
    assert all("\ufffd" not in f.text for f in streamed)


def test_a_stop_string_ends_the_request_and_never_reaches_the_client(tokenizer):
    text = "alpha beta gamma STOP delta epsilon"
    tokens = tokenizer(text)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=100, stop=["STOP"])
    frames = run(tokenizer, tokens, params, stream=True)
    streamed = "".join(f.text for f in frames)
    assert frames[-1].finished and frames[-1].finish_reason == "stop" and frames[-1].stop_reason == "STOP"
    assert streamed == "alpha beta gamma "
    assert all("S" not in f.text for f in frames)  # held back until it was known not to start a stop string
