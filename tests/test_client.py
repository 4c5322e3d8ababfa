"""The Python clients and the `generate` / `chat` commands against one real node serving the tiny model."""

import asyncio
import os
import select
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from pdrt.client import AsyncClient, Client, SamplingParams, error_from_reply
from pdrt.errors import (
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    ProtocolError,
    RequestTimeoutError,
    ServerError,
    ServerUnreachableError,
    UnknownRequestError,
)
from pdrt.testing.node import Node, free_port
from pdrt.wire import PROTOCOL_VERSION, Error, Hello, Ready, client_reply_decoder, encode
from tests.system_client import default_sigint

GREEDY = SamplingParams(temperature=0, max_tokens=12)
ENDLESS = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)  # runs until cancelled
PROMPTS = ["def main():", "import os\nimport sys\n", "class Parser(object):\n    def parse(self, text):",
           "# a comment", "return [x for x in", "while True:\n    pass"]


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory) -> Node:
    with Node(tmp_path_factory.mktemp("client-node"), str(model_dirs["llama"])) as node, Client(node.address) as c:
        c.wait_ready(expected_workers=2, timeout_s=60)
        yield node


@pytest.fixture(scope="module")
def address(node: Node) -> str:
    return node.address


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


async def eventually_no_open_requests(client: AsyncClient, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.status()).num_open_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (await client.status()).num_open_requests == 0


def test_streamed_and_non_streamed_greedy_tokens_equal_transformers_generate(address, tokenizer, references):
    async def main():
        async with AsyncClient(address) as client:
            whole = await client.generate(PROMPTS[0], params=GREEDY)
            stream = client.stream(PROMPTS[0], params=GREEDY)
            deltas = [delta async for delta in stream]
            return whole, stream.completion, deltas

    whole, streamed, deltas = run(main())
    ids = prompt_ids(tokenizer, PROMPTS[0])
    assert whole.token_ids == streamed.token_ids == references["llama"].greedy(ids)
    assert whole.text == streamed.text == "".join(d.text for d in deltas)
    assert whole.finish_reason == streamed.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(whole.token_ids)
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_one_async_client_carries_concurrent_requests_streamed_and_not(address, tokenizer, references):
    async def main():
        async with AsyncClient(address) as client:
            async def streamed(text):
                stream = client.stream(text, params=GREEDY)
                async for _ in stream:
                    pass
                return stream.completion

            jobs = [streamed(p) if i % 2 else client.generate(p, params=GREEDY) for i, p in enumerate(PROMPTS)]
            results = await asyncio.gather(*jobs)
            return results, client.num_open_requests

    results, num_left = run(main())
    for text, completion in zip(PROMPTS, results, strict=True):
        assert completion.token_ids == references["llama"].greedy(prompt_ids(tokenizer, text)), text
    assert num_left == 0


def test_chat_messages_go_through_the_chat_template(address, tokenizer, references):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with Client(address) as client:
        completion = client.generate(messages=messages, params=GREEDY)
    assert completion.usage.prompt_tokens == len(ids)
    assert completion.token_ids == references["llama"].greedy(list(ids))


def test_cancel_mid_stream_ends_the_stream_with_finish_reason_cancelled(address):
    async def main():
        async with AsyncClient(address) as client:
            stream = client.stream(PROMPTS[1], params=ENDLESS)
            deltas = []
            async for delta in stream:
                deltas.append(delta)
                if len(deltas) == 3:
                    await stream.cancel()
            await eventually_no_open_requests(client)
            return stream.completion, deltas, client.num_open_requests

    completion, deltas, num_left = run(main())
    assert deltas[-1].finished and completion.finish_reason == "cancelled"
    assert 3 <= len(completion.token_ids) < ENDLESS.max_tokens
    assert completion.usage.completion_tokens == len(completion.token_ids)
    assert num_left == 0


def test_leaving_the_loop_early_cancels_the_request_on_the_server(address):
    async def main():
        async with AsyncClient(address) as client:
            async for _ in client.stream(PROMPTS[2], params=ENDLESS):
                break
            await eventually_no_open_requests(client)
            return client.num_open_requests

    assert run(main()) == 0


def test_a_client_timeout_raises_and_leaves_no_open_request_on_either_side(address):
    async def main():
        async with AsyncClient(address) as client:
            with pytest.raises(RequestTimeoutError) as caught:
                await client.generate(PROMPTS[3], params=ENDLESS, timeout_s=0.3)
            assert client.num_open_requests == 0  # the client forgot the request at once
            await eventually_no_open_requests(client)
            return caught.value

    assert run(main()).code == "timeout"


def test_invalid_parameters_are_refused_by_the_client_before_sending():
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError):
        AsyncClient("tcp://127.0.0.1:1").stream(prompt="a", token_ids=[1])


def test_errors_the_server_reports_raise_their_typed_errors(address):
    with Client(address) as client:
        with pytest.raises(InvalidRequestError) as caught:
            client.generate(token_ids=[-1], params=GREEDY)
        assert caught.value.code == "invalid_request"
        with pytest.raises(PromptTooLongError):
            client.generate(token_ids=[5] * client.ready.max_model_len, params=GREEDY)
        with pytest.raises(InvalidRequestError):
            list(client.stream(token_ids=[], params=GREEDY))


def test_the_server_answers_raw_frames_with_typed_error_replies(address):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)

    def ask(frame: bytes):
        sock.send(frame)
        assert sock.poll(10_000), "no reply"
        return client_reply_decoder.decode(sock.recv())

    try:
        before = ask(msgspec.msgpack.encode(["get_status"]))
        assert isinstance(before, Error) and before.code == "handshake_required"
        wrong = ask(encode(Hello(PROTOCOL_VERSION + 1)))
        assert isinstance(wrong, Error) and wrong.code == "unsupported_version"
        assert isinstance(ask(encode(Hello(PROTOCOL_VERSION, "raw"))), Ready)
        # SamplingParams validates on construction, so a bad value only reaches the server in hand-made bytes.
        bad = ask(msgspec.msgpack.encode(["generate", "bad-1", "hi", None, None, {"top_p": 0.0}]))
        assert (bad.code, bad.request_id) == ("invalid_sampling_params", "bad-1")
        assert isinstance(error_from_reply(bad), InvalidSamplingParamsError)
        unknown = ask(msgspec.msgpack.encode(["cancel", "never-sent"]))
        assert (unknown.code, unknown.request_id) == ("unknown_request", "never-sent")
        assert isinstance(error_from_reply(unknown), UnknownRequestError)
        garbage = ask(b"\xc1")
        assert garbage.code == "invalid_frame"
        exc = error_from_reply(wrong)
        assert isinstance(exc, ProtocolError) and exc.code == "unsupported_version"
        novel = error_from_reply(Error("brand_new", "from a newer server"))
        assert isinstance(novel, ServerError) and novel.code == "brand_new"
    finally:
        sock.close()
        ctx.term()


def test_connecting_where_no_server_listens_raises_unreachable():
    with pytest.raises(ServerUnreachableError) as caught:
        Client(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5).connect()
    assert caught.value.code == "unreachable"


def test_the_sync_client_generates_streams_cancels_and_reports_status(address, tokenizer, references):
    with Client(address) as client:
        whole = client.generate(PROMPTS[4], params=GREEDY)
        stream = client.stream(PROMPTS[4], params=GREEDY)
        assert "".join(d.text for d in stream) == whole.text
        assert stream.completion.token_ids == whole.token_ids == references["llama"].greedy(
            prompt_ids(tokenizer, PROMPTS[4]))
        endless = client.stream(PROMPTS[5], params=ENDLESS)
        for i, _ in enumerate(endless):
            if i == 1:
                left = client.status().counters["open_answer_tokens_left"]  # what the open stream may still say
                assert ENDLESS.max_tokens > left > ENDLESS.max_tokens // 2  # two outputs in: fewer than asked
                endless.cancel()
        assert endless.completion.finish_reason == "cancelled"
        deadline = time.monotonic() + 10
        while client.status().num_open_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        status = client.status()
        assert status.num_open_requests == 0 and status.counters["open_answer_tokens_left"] == 0
        assert sorted(w.role for w in status.workers) == ["decode", "prefill"]


def test_a_draft_typed_key_by_key_with_backspaces_answers_like_the_same_prompt_sent_at_once(address):
    text = "class Parser(object):\n    def parse(self, text):\n        return [tok for tok in text.split()]\n" * 6
    history = [{"role": "user", "content": "Read this."}, {"role": "assistant", "content": "Go on."}]
    with Client(address) as client:
        draft = client.draft(messages=history, session_id="typist")
        typed = ""
        for i, char in enumerate(text):
            if i % 37 == 5:  # a typo, erased with backspace
                draft.set_text(typed + "#")
            typed += char
            draft.set_text(typed)
        submitted = draft.submit(GREEDY)
        tokens = [t for delta in submitted for t in delta.token_ids]
        once = client.generate(messages=[*history, {"role": "user", "content": text}], params=GREEDY)
        assert tokens == once.token_ids and submitted.completion.text == once.text
        abandoned = client.draft()
        abandoned.append("never sent")
        abandoned.abandon()
        counters = client.status().counters
        assert counters["drafts_submitted"] >= 1 and counters["drafts_abandoned"] >= 1


def read_terminal(fd: int, screen: bytes, until, timeout_s: float = 60.0) -> bytes:
    """Read what a program writes to its terminal until `until(screen)` holds."""
    deadline = time.monotonic() + timeout_s
    while not until(screen):
        if time.monotonic() > deadline:
            raise AssertionError(f"the terminal shows {screen!r}")
        if select.select([fd], [], [], 0.5)[0]:
            screen += os.read(fd, 4096)
    return screen


def test_pdrt_chat_at_a_terminal_streams_each_key_as_a_draft_and_answers_on_enter(address):
    import pty

    question = "explain what the parse method of this class does, line by line, please"
    with Client(address) as client:
        expected = client.generate(messages=[{"role": "user", "content": question}],
                                   params=SamplingParams(temperature=0, max_tokens=8)).text
        before = client.status().counters.get("draft_updates", 0)
    controller, terminal = pty.openpty()
    chat = subprocess.Popen([sys.executable, "-m", "pdrt.cli", "chat", "--server", address, "--max-tokens", "8"],
                            stdin=terminal, stdout=terminal, stderr=subprocess.DEVNULL, close_fds=True)
    os.close(terminal)
    try:
        screen = read_terminal(controller, b"", lambda s: b"> " in s)  # the prompt, once connected
        for char in question + "x\x7f":  # the last key is a typo, erased with backspace
            os.write(controller, char.encode())
            time.sleep(0.01)
        os.write(controller, b"\r")
        screen = read_terminal(controller, screen, lambda s: expected.encode() in s.replace(b"\r\n", b"\n"))
        screen = read_terminal(controller, screen, lambda s: s.endswith(b"> "))  # the next prompt
        os.write(controller, b"\x04")  # Ctrl-D at an empty prompt: the chat ends
        assert chat.wait(30) == 0
    finally:
        chat.kill()
        os.close(controller)
    with Client(address) as client:
        assert client.status().counters["draft_updates"] > before + 2  # the question reached the server while typed


def start_pdrt(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.Popen([sys.executable, "-m", "pdrt.cli", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_sigint)


def test_pdrt_generate_and_pdrt_chat_print_the_streamed_answers(address):
    flags = ("--server", address, "--max-tokens", "8")
    # Both commands run at once: each one's interpreter start costs more than its answers.
    generate = start_pdrt("generate", "What is a tuple?", *flags)
    chat = start_pdrt("chat", *flags)
    params = SamplingParams(temperature=0, max_tokens=8)
    with Client(address) as client:
        def answer(*turns: str) -> str:
            roles = ["user", "assistant"] * len(turns)
            messages = [{"role": r, "content": t} for r, t in zip(roles, turns, strict=False)]
            return client.generate(messages=messages, params=params).text

        expected_generate = answer("What is a tuple?")
        first = answer("hello")
        expected_chat = [first, answer("hello", first, "and then?"), answer("hi again")]
    out, err = generate.communicate("", timeout=60)
    assert generate.returncode == 0, err
    assert out == expected_generate + "\n"
    out, err = chat.communicate("hello\nand then?\n/reset\nhi again\n/exit\nnever asked\n", timeout=60)
    assert chat.returncode == 0, err
    assert out == "".join(a + "\n" for a in expected_chat)
    assert "conversation cleared" in err


def test_ctrl_c_in_pdrt_chat_cancels_the_answer_and_the_chat_goes_on(address):
    chat = start_pdrt("chat", "--server", address, "--max-tokens", "3000")
    chat.stdin.write("hello\n")
    chat.stdin.flush()
    assert chat.stdout.read(8)  # the answer is streaming
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate("/exit\n", timeout=60)
    assert chat.returncode == 0, err
    assert "answer cancelled" in err
    with Client(address) as client:
        deadline = time.monotonic() + 10
        while client.status().num_open_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status().num_open_requests == 0

def test_a_client_says_hello_again_and_resends_after_the_gateway_restarts(node, address):
    # Last in this module: it restarts the module's gateway.
    with Client(address, timeout_s=30) as client:
        expected = client.generate(PROMPTS[0], params=GREEDY)
        os.kill(node.child_pids()["gateway"], signal.SIGKILL)
        time.sleep(0.2)
        # Sent while the gateway is down: the new one answers `handshake_required`, and the client recovers.
        again = client.generate(PROMPTS[0], params=GREEDY)
        assert again.token_ids == expected.token_ids
        assert client.status().num_open_requests == 0
