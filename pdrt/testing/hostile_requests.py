"""Valid but hostile requests on one connection: the fuzz suite's `valid_hostile` inputs (pdrt/testing/fuzz.py).

Every message here passes the protocol's checks; what makes it hostile is
how much it asks for. In turn: a `generate` with every field at its limit
(sixteen stop strings of 256 characters, 256 stop token ids, the largest
top_k and seed, the highest temperature, logprobs; twice a prompt as long as
the context holds, and now and then a max_tokens no pool could hold); a
flood of drafts, past the connection's share of them, left to expire; chat requests under a few
session ids, each followed by warmups of them; continuations of random
output; a cancel sent the moment a request's first token arrives, while
its KV is being handed over; and connections that say `hello` and leave.
Each request must end with its tokens or a typed error; what the refusals
were is counted by code.
"""

import random
import time
from collections import Counter

import zmq

from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.engine.sampling_params import (
    MAX_CACHE_SALT_CHARS,
    MAX_INT,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from pdrt.engine.sampling_params import SamplingParams as Params
from pdrt.wire import (
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    DraftAbandon,
    DraftAppend,
    DraftOpen,
    Error,
    Generate,
    Hello,
    Ready,
    Tokens,
    Warmup,
    client_reply_decoder,
    encode,
)

REPLY_TIMEOUT_S = 60.0
DRAFT_BURST = 600  # the first flood of drafts outgrows the connection's share of them (half of 1024)
DRAFTS_PER_INPUT = 3
SESSIONS = 20
LONG_PROMPTS = 2  # prompts as long as the context holds: each takes seconds to prefill on a CPU


class HostileClient:
    def __init__(self, ctx: zmq.Context, address: str, prompts: list[list[int]], seed: int = 0) -> None:
        self.ctx = ctx
        self.address = address
        self.rng = random.Random(seed)
        self.vocab = sorted({t for p in prompts for t in p})  # token ids the model surely has
        self.prompts = prompts
        self.sock = make_socket(ctx, SocketSpec(zmq.DEALER, address, bind=False))
        self.open: set[str] = set()  # requests not ended yet
        self.drafts: list[str] = []
        self.refusals: Counter[str] = Counter()
        self.num_inputs = 0
        self.max_model_len = self._hello()

    def _hello(self) -> int:
        self.sock.send(encode(Hello(PROTOCOL_VERSION, "hostile")))
        if not self.sock.poll(int(REPLY_TIMEOUT_S * 1000)):
            raise TimeoutError("the gateway did not answer hello")
        ready = client_reply_decoder.decode(self.sock.recv())
        assert isinstance(ready, Ready), ready
        return ready.max_model_len

    def run(self, n: int) -> int:
        """Send `n` inputs; the number of requests that never ended."""
        kinds = [self._at_limits, self._drafts, self._sessions, self._continuation, self._cancel_at_handoff]
        long_at = {n * k // LONG_PROMPTS for k in range(LONG_PROMPTS)}
        for i in range(n):
            if i in long_at:
                self._at_limits(i, long=True)
            else:
                kinds[i % len(kinds)](i)
            if i % 100 == 99:
                self._hello_and_leave()
            self.num_inputs += 1
            self._read(0)
        for draft_id in self.drafts:
            self.sock.send(encode(DraftAbandon(draft_id)))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while self.open and time.monotonic() < deadline:
            self._read(100)
        return len(self.open)

    def close(self) -> None:
        self.sock.close(linger=0)

    # -- the kinds of input ----------------------------------------------------------------------

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def _generate(self, message: Generate) -> None:
        self.sock.send(encode(message))
        self.open.add(message.request_id)

    def _at_limits(self, i: int, long: bool = False) -> None:
        endless = i % 50 == 0 and not long  # its deadline ends it, unless no pool holds its whole context
        params = Params(temperature=100.0 if i % 2 else 0.0, top_k=MAX_INT, top_p=1.0, seed=2**63 - 1,
                        max_tokens=MAX_INT if endless else 4, stop=["\x00" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                        stop_token_ids=self._tokens(MAX_STOP_TOKEN_IDS), logprobs=True,
                        cache_salt="\x00" * MAX_CACHE_SALT_CHARS)
        prompt = self._tokens(self.max_model_len - 5 if long else 64)
        self._generate(Generate(f"h{i}", token_ids=prompt, params=params, timeout_s=1.0 if endless else None))

    def _drafts(self, i: int) -> None:
        for k in range(DRAFTS_PER_INPUT if self.drafts else DRAFT_BURST):
            draft_id = f"d{i}-{k}"
            self.sock.send(encode(DraftOpen(draft_id)))
            self.sock.send(encode(DraftAppend(draft_id, "type ahead " * self.rng.randrange(1, 40))))
            self.drafts.append(draft_id)

    def _sessions(self, i: int) -> None:
        session = f"s{i % SESSIONS}"
        self._generate(Generate(f"h{i}", messages=[ChatMessage("user", f"turn {i}")], session_id=session,
                                params=Params(temperature=0.0, max_tokens=2)))
        for _ in range(3):
            self.sock.send(encode(Warmup(session)))

    def _continuation(self, i: int) -> None:
        output = self._tokens(self.rng.randrange(1, 20))
        self._generate(Generate(f"h{i}", token_ids=self.rng.choice(self.prompts), continuation=output,
                                params=Params(temperature=0.8, seed=i, max_tokens=len(output) + 3)))

    def _cancel_at_handoff(self, i: int) -> None:
        rid = f"h{i}"
        self._generate(Generate(rid, token_ids=self.rng.choice(self.prompts), params=Params(temperature=0.0,
                                                                                         max_tokens=16)))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while rid in self.open and not self._read(100, first_of=rid) and time.monotonic() < deadline:
            pass
        self.sock.send(encode(Cancel(rid)))

    def _hello_and_leave(self) -> None:
        passing = make_socket(self.ctx, SocketSpec(zmq.DEALER, self.address, bind=False))
        passing.send(encode(Hello(PROTOCOL_VERSION, "passing")))
        passing.close(linger=100)

    # -- replies --------------------------------------------------------------------------------

    def _read(self, timeout_ms: int, first_of: str | None = None) -> bool:
        """Take what has arrived (waiting up to `timeout_ms` for the first); True once a frame of `first_of` came."""
        seen = False
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            for frame in self.sock.recv_multipart():
                reply = client_reply_decoder.decode(frame)
                rid = getattr(reply, "request_id", None)
                seen |= rid == first_of
                if isinstance(reply, Error):
                    self.refusals[reply.code] += 1
                    self.open.discard(rid)
                elif isinstance(reply, Tokens) and reply.finished:
                    self.open.discard(rid)
        return seen
