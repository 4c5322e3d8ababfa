"""Type-ahead prefill and warmup, measured the way a user meets them: time to first token after Enter.

Against a running `pdrt up` node (started here, 1 prefill + 1 decode worker):

  (a) prompts of about 128, 512 and 2048 tokens are typed into a draft in
      bursts with pauses, then submitted; TTFT is taken from the submit to
      the first token. The same prompt sent at once (`Generate`) is the
      peer. Typing runs at --typing-rate characters per second: faster than
      people (about 50/s) to save time, and well below the prefill rate,
      which the script measures and prints beside it.
  (b) a session with about 2000 tokens of conversation: TTFT of its next
      turn cold (the conversation is no longer in any cache) and after a
      warmup datagram (sent when the user focuses the input box; the turn
      is submitted once the warmup's prefill is done, as typing the turn
      takes longer than that).

Medians of --repeats. Both models when SmolLM2 is fetched; the last line
gives SmolLM2's figures: `typeahead ttft_2048_vs_128=X cold_vs_warm=Y`, X
with type-ahead, Y as cold TTFT over warm TTFT.
"""

import argparse
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path

import zmq
from transformers import AutoTokenizer

from pdrt.engine.sampling_params import SamplingParams
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.node import Node, free_port
from pdrt.testing.tiny_model import build_tiny_model
from pdrt.warmup.datagram import sign
from pdrt.wire import (
    PROTOCOL_VERSION,
    ChatMessage,
    DraftAppend,
    DraftOpen,
    DraftSubmit,
    Error,
    Generate,
    GetStatus,
    Hello,
    Tokens,
    client_reply_decoder,
    encode,
)

KEY = "bench-warmup-key"
PARAMS = SamplingParams(temperature=0, max_tokens=4)
PROMPT_TOKENS = (128, 512, 2048)
HISTORY_TOKENS = 2000
CORPUS_MODULES = ("argparse", "asyncio.base_events", "collections", "dataclasses", "email.message", "typing",
                  "inspect", "pathlib", "subprocess", "tarfile", "unittest.case", "zipfile")


def corpus() -> str:
    import importlib
    import inspect

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in CORPUS_MODULES)


class Client:
    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.send(Hello(PROTOCOL_VERSION))
        self.recv()

    def send(self, message) -> None:
        self.socket.send(encode(message))

    def recv(self, timeout_s: float = 300.0):
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError("the node stopped answering")
        reply = client_reply_decoder.decode(self.socket.recv())
        if isinstance(reply, Error):
            raise RuntimeError(f"{reply.code}: {reply.message}")
        return reply

    def ttft(self, request_id: str, sent_at: float) -> float:
        """Seconds from `sent_at` to the request's first token; reads the rest of it too."""
        first = None
        while True:
            reply = self.recv()
            if isinstance(reply, Tokens) and reply.request_id == request_id:
                if first is None and reply.token_ids:
                    first = time.perf_counter() - sent_at
                if reply.finished:
                    assert first is not None
                    return first

    def status(self):
        self.send(GetStatus())
        return self.recv()


def cut(tokenizer, text: str, num_tokens: int, start: int) -> str:
    ids = tokenizer(text[start: start + num_tokens * 8])["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


def type_draft(client: Client, draft_id: str, text: str, rate: float, rng: random.Random) -> None:
    """Bursts of a few characters at `rate` on average, with a thinking pause now and then."""
    typed = 0
    while typed < len(text):
        n = rng.randint(2, 12)
        client.send(DraftAppend(draft_id, text[typed: typed + n]))
        typed += n
        pause = n / rate * rng.uniform(0.5, 1.5)
        if rng.random() < 0.02:
            pause += rng.uniform(0.3, 0.8)
        time.sleep(pause)


def wait_idle(client: Client, timeout_s: float = 120.0) -> None:
    """Until the prefill worker has no prompt tokens left to compute.

    Loads come with heartbeats and views (a quarter second each), so first wait out a view that predates
    the last message sent.
    """
    time.sleep(1.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads = [w.load for w in client.status().workers if w.role == "prefill"]
        if all(load.num_waiting_tokens == 0 for load in loads):
            return
        time.sleep(0.05)
    raise TimeoutError("the prefill worker stayed busy")


def measure_typeahead(client: Client, tokenizer, text: str, rate: float, repeats: int, rng: random.Random):
    rows = []
    for size in PROMPT_TOKENS:
        typed, once = [], []
        for r in range(repeats):
            prompt = cut(tokenizer, text, size, start=rng.randrange(len(text) // 2))
            draft_id = f"d{size}-{r}"
            client.send(DraftOpen(draft_id, messages=[]))
            type_draft(client, draft_id, prompt, rate, rng)
            client.send(DraftSubmit(draft_id, f"typed{size}-{r}", params=PARAMS))
            typed.append(client.ttft(f"typed{size}-{r}", time.perf_counter()))
            wait_idle(client)
            other = cut(tokenizer, text, size, start=rng.randrange(len(text) // 2))  # no prefix cache help
            client.send(Generate(f"once{size}-{r}", messages=[ChatMessage("user", other)], params=PARAMS))
            once.append(client.ttft(f"once{size}-{r}", time.perf_counter()))
            wait_idle(client)
        rows.append((size, statistics.median(typed), statistics.median(once)))
        print(f"  {size:5d}-token prompt  TTFT typed ahead {rows[-1][1] * 1e3:8.1f} ms   "
              f"sent at once {rows[-1][2] * 1e3:8.1f} ms", flush=True)
    return rows


def measure_warmup(client: Client, node: Node, tokenizer, text: str, repeats: int, flush_tokens: int,
                   rng: random.Random) -> tuple[float, float]:
    histories = {}
    for kind in ("cold", "warm"):
        for r in range(repeats):
            session = f"{kind}{r}"
            history = [ChatMessage("system", cut(tokenizer, text, HISTORY_TOKENS - 40, rng.randrange(len(text) // 2))),
                       ChatMessage("user", "Summarize the code above in one sentence.")]
            client.send(Generate(f"setup-{session}", messages=history, params=PARAMS, session_id=session))
            client.ttft(f"setup-{session}", time.perf_counter())
            histories[session] = history
    for i in range(0, flush_tokens, 1000):  # push every conversation out of the prefix caches
        client.send(Generate(f"flush{i}", prompt=cut(tokenizer, text, 1000, rng.randrange(len(text) // 2)),
                             params=SamplingParams(temperature=0, max_tokens=1)))
        client.ttft(f"flush{i}", time.perf_counter())
    results: dict[str, list[float]] = {"cold": [], "warm": []}
    for r in range(repeats):
        for kind in ("cold", "warm"):
            session = f"{kind}{r}"
            if kind == "warm":
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.sendto(sign(KEY.encode(), session, node.model_name), ("127.0.0.1", node.warmup_port))
                wait_idle(client)
            turn = [*histories[session], ChatMessage("assistant", "It is a module."),
                    ChatMessage("user", "Which function would you test first?")]
            client.send(Generate(f"turn-{session}", messages=turn, params=PARAMS, session_id=session))
            results[kind].append(client.ttft(f"turn-{session}", time.perf_counter()))
            wait_idle(client)
    counters = client.status().counters
    cold, warm = statistics.median(results["cold"]), statistics.median(results["warm"])
    print(f"  session with ~{HISTORY_TOKENS} tokens of history: TTFT cold {cold * 1e3:8.1f} ms   "
          f"after warmup {warm * 1e3:8.1f} ms   (warmup hits {counters.get('warmup_hits', 0)}, "
          f"misses {counters.get('warmup_misses', 0)}, prefilled {counters.get('warmup_tokens', 0)} tokens)",
          flush=True)
    return cold, warm


def prefill_rate(client: Client, tokenizer, text: str, rng: random.Random) -> float:
    prompt = cut(tokenizer, text, 1024, rng.randrange(len(text) // 2))
    start = time.perf_counter()
    client.send(Generate("rate", prompt=prompt, params=SamplingParams(temperature=0, max_tokens=1)))
    client.ttft("rate", start)
    return 1024 / (time.perf_counter() - start)


def run(model: str, workdir: Path, repeats: int, typing_rate: float | None, kv_tokens: int) -> tuple[float, float]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = corpus()
    rng = random.Random(0)
    warmup_port = free_port()
    bytes_per_token = _kv_bytes_per_token(model)
    with Node(workdir, model, engine={"kv_cache_bytes": kv_tokens * bytes_per_token},
              extra={"warmup": {"key": KEY, "port": warmup_port}}, ready_timeout_s=300) as node:
        node.warmup_port, node.model_name = warmup_port, Path(model).name
        client = Client(node.address)
        rate = prefill_rate(client, tokenizer, text, rng)
        chars_per_token = len(text[:20000]) / len(tokenizer(text[:20000])["input_ids"])
        typing = typing_rate or min(400.0, rate * chars_per_token / 4)
        print(f"{Path(model).name}: prefill {rate:.0f} tokens/s ({rate * chars_per_token:.0f} chars/s); "
              f"typing at {typing:.0f} chars/s ({typing / chars_per_token:.0f} tokens/s)", flush=True)
        wait_idle(client)
        rows = measure_typeahead(client, tokenizer, text, typing, repeats, rng)
        cold, warm = measure_warmup(client, node, tokenizer, text, repeats, 2 * kv_tokens, rng)
    ratio = rows[-1][1] / rows[0][1]
    print(f"  ttft_2048_vs_128 with type-ahead {ratio:.2f} (sent at once {rows[-1][2] / rows[0][2]:.2f}); "
          f"cold_vs_warm {cold / warm:.2f}", flush=True)
    return ratio, cold / warm


def _kv_bytes_per_token(model: str) -> int:
    import json

    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--typing-rate", type=float, help="characters per second (default: min(400, prefill/4))")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV pool per worker, in tokens")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="pdrt-bench-typeahead-"))
    run(str(build_tiny_model(workdir / "tiny")), workdir, args.repeats, args.typing_rate, args.kv_tokens)
    if not is_fetched():
        print("SmolLM2 is not fetched (`pdrt model fetch`); the last line repeats the tiny model's figures")
        ratio, cold_vs_warm = run(str(build_tiny_model(workdir / "tiny2")), workdir, args.repeats,
                                  args.typing_rate, args.kv_tokens)
    else:
        ratio, cold_vs_warm = run(str(default_model_dir()), workdir, args.repeats, args.typing_rate, args.kv_tokens)
    print(f"typeahead ttft_2048_vs_128={ratio:.3f} cold_vs_warm={cold_vs_warm:.3f}")


if __name__ == "__main__":
    main()
