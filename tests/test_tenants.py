"""Tenants (named API keys) and cache salts against a real `pdrt up` (tiny model): what one tenant's requests
reveal of another's (cached_tokens), and how much of the gateway one tenant may hold."""

import asyncio

import openai
import pytest

from pdrt.client import Client, SamplingParams
from pdrt.testing.node import Node, free_port
from tests.system_client import used_blocks, wait_for

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
SHARED_KEY = "key-shared"
MAX_OPEN = 4
PROMPT = [(i * 37) % 250 + 3 for i in range(200)]  # token ids: 12 full blocks of 16


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    http_port = free_port()
    with Node(tmp_path_factory.mktemp("tenants"), str(model_dirs["llama"]),
              extra={"gateway": {"http_port": http_port, "api_key": SHARED_KEY, "api_keys": KEYS,
                                 "max_open_requests": MAX_OPEN}}) as running:
        running.http = f"http://127.0.0.1:{http_port}"
        yield running


def api(node, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.http + "/v1", api_key=key, max_retries=0, timeout=60)


def complete(client: openai.OpenAI, prompt: list[int], salt: str | None = None) -> tuple[str, int]:
    """The greedy completion of `prompt` and the prompt tokens it found cached."""
    extra = {"cache_salt": salt} if salt is not None else {}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def test_tenants_and_salts_share_cached_prompts_only_with_their_own(node):
    alpha, beta, shared = api(node, KEYS["alpha"]), api(node, KEYS["beta"]), api(node, SHARED_KEY)
    first = complete(alpha, PROMPT)
    assert first[1] == 0
    again = complete(alpha, PROMPT)
    assert again[1] >= 160 and again[0] == first[0]  # alpha's own prompt: cached
    assert complete(beta, PROMPT) == (first[0], 0)  # beta learns nothing of alpha's prompt
    assert complete(shared, PROMPT) == (first[0], 0)  # nor does the unnamed key
    assert complete(alpha, PROMPT, salt="x") == (first[0], 0)  # another salt within alpha: a cache of its own
    assert complete(alpha, PROMPT, salt="x")[1] >= 160
    assert complete(beta, PROMPT, salt="x") == (first[0], 0)  # the same salt in another tenant's name: not shared
    with Client(node.address) as native:  # native clients (no tenant) with the salt of the unnamed key's requests
        params = SamplingParams(temperature=0, max_tokens=6)
        assert native.generate(token_ids=PROMPT, params=params).usage.cached_tokens >= 160
        salted = SamplingParams(temperature=0, max_tokens=6, cache_salt="x")
        assert native.generate(token_ids=PROMPT, params=salted).usage.cached_tokens == 0


def test_a_draft_prefills_under_its_salt_and_its_request_keeps_it(node):
    prompt = "Explain the difference between a list and a tuple, with examples. " * 6
    with Client(node.address) as client:
        params = SamplingParams(temperature=0, max_tokens=6)
        draft = client.draft(cache_salt="typist")
        draft.append(prompt)
        typed = [t for delta in draft.submit(params=params) for t in delta.token_ids]
        other = client.generate(prompt=prompt, params=params)
        assert other.usage.cached_tokens == 0  # the draft's KV is the salt's alone
        mine = client.generate(prompt=prompt, params=SamplingParams(temperature=0, max_tokens=6,
                                                                    cache_salt="typist"))
        assert mine.usage.cached_tokens > 0
        assert typed == other.token_ids == mine.token_ids


def test_a_tenant_holds_at_most_its_share_of_open_requests(node):
    async def main() -> None:
        clients = {name: openai.AsyncOpenAI(base_url=node.http + "/v1", api_key=key, max_retries=0, timeout=60)
                   for name, key in KEYS.items()}
        alpha, beta = clients["alpha"], clients["beta"]
        streams = [await alpha.completions.create(model="tiny", prompt="hi", max_tokens=3000, stream=True,
                                                  extra_body={"ignore_eos": True}) for _ in range(MAX_OPEN // 2)]
        for stream in streams:
            await stream.__anext__()
        with pytest.raises(openai.RateLimitError) as info:
            await alpha.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert "its share" in info.value.body["message"]
        served = await beta.completions.create(model="tiny", prompt="hi", max_tokens=4)  # beta is not shut out
        assert served.usage.completion_tokens == 4
        for stream in streams:
            await stream.close()
        for client in clients.values():
            await client.close()

    asyncio.run(main())
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)


def test_every_key_opens_the_api_and_no_other(node):
    for key in [*KEYS.values(), SHARED_KEY]:
        assert api(node, key).models.list().data
    with pytest.raises(openai.AuthenticationError):
        api(node, "key-gamma").models.list()
