"""Shared fixtures: tiny real checkpoints, prompts of mixed lengths and transformers' own greedy outputs; a gateway's
request table over worker inboxes that never answer."""

import inspect
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdrt.engine import EngineConfig, LLMEngine
from pdrt.engine.attention import AttentionMetadata, PrefillSpan
from pdrt.engine.model_loader import LoadedModel, load_model
from pdrt.node_config import NodeConfig
from pdrt.roles.messaging import Outbox
from pdrt.roles.request_table import RequestTable
from pdrt.roles.router import Router
from pdrt.testing.node import free_port
from pdrt.testing.tiny_model import build_tiny_model
from pdrt.typeahead.draft_book import DraftBook
from pdrt.warmup.warmups import Warmups
from pdrt.wire import Load, WorkerInfo, internal_decoder

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


def prompt_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The decoder's logits `[len(ids), vocab]` for a prompt prefilled from an empty pool."""
    runner = LLMEngine(EngineConfig(model="decoder", num_blocks=64), loaded=loaded).runner
    n = len(ids)
    meta = AttentionMetadata(runner.pool, runner.workspace, runner.columns[:n], 0, None,
                             [PrefillSpan(0, n, 0, None, None)])
    with torch.inference_mode():
        return loaded.decoder(torch.tensor([ids]), runner.columns[:n].unsqueeze(0), 0, meta)


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


@pytest.fixture
def silent_inbox():
    """A ROUTER on a free port that receives and never answers (a peer that is frozen, or only listens): the
    socket and its address."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)  # every wait has a timeout
    address = f"tcp://127.0.0.1:{free_port()}"
    sock.bind(address)
    yield sock, address
    ctx.destroy(linger=0)


@pytest.fixture
def workers():
    """A prefill and a decode worker's inboxes that read what the gateway sends and never answer."""
    ctx = zmq.Context()
    inboxes = {}
    for role in ("prefill", "decode"):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVTIMEO, 5000)  # every wait has a timeout
        address = f"tcp://127.0.0.1:{free_port()}"
        sock.bind(address)
        inboxes[role] = (WorkerInfo(f"{role}-0", "i1", role, address, Load(num_free_blocks=100)), sock)
    yield inboxes
    ctx.destroy(linger=0)


@pytest.fixture
def table(model_dirs, tokenizer, workers):
    """A gateway's request table routing to `workers`; what it sends its clients is in `table.replies`."""
    config = NodeConfig.from_json(msgspec.json.encode({"model": str(model_dirs["llama"]), "mode": "disaggregated"}))
    ctx = zmq.asyncio.Context()
    router = Router()
    router.update([info for info, _ in workers.values()])
    outbox = Outbox(ctx, "gateway-0")
    counters: Counter[str] = Counter()
    x = config.experimental
    ids = iter(range(1 << 30))

    def new_id() -> str:
        return f"gateway-0:{next(ids)}"

    drafts = DraftBook(tokenizer, 1 << 16, 2048, router, outbox, "prefill", x.max_drafts, x.draft_ttl_s, new_id,
                       counters)
    warmups = Warmups(x.warmup_max_reservations, x.warmup_ttl_s, tokenizer, 2048, router, outbox, "prefill", new_id,
                      counters)
    replies: list[msgspec.Struct] = []
    made = RequestTable(config, tokenizer, router, outbox, "tcp://127.0.0.1:1", drafts, warmups,
                        lambda _, frames: replies.extend(frames), "gateway-0")
    made.replies = replies
    yield made
    for sock in outbox.sockets.values():
        sock.close(linger=0)
    ctx.destroy(linger=0)


def received(sock: zmq.Socket) -> msgspec.Struct:
    """The next internal message a worker inbox of `workers` got."""
    _, payload = sock.recv_multipart()
    return internal_decoder.decode(payload)
