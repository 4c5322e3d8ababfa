"""The benchmark over pdrt's native protocol: token-id prompts, streamed, output length forced.

Prompts go as token ids, so their length is exact, and `ignore_eos` makes
every answer exactly as long as the workload says. The gateway streams one
`Tokens` frame per step; the first one is the first token (TTFT), and each
frame's arrival stamps the tokens it carries.
"""

from pdrt.bench.driver import Clock, ServerInfo, Target
from pdrt.bench.prompts import DEFAULT_VOCAB_SIZE, PromptBuilder
from pdrt.bench.record import RequestRecord
from pdrt.bench.workloads import RequestShape
from pdrt.client import AsyncClient, SamplingParams
from pdrt.errors import PdrtError


class NativeDriver:
    name = "native"

    def __init__(self, target: Target) -> None:
        self.target = target
        self.client = AsyncClient(target.address, timeout_s=target.request_timeout_s, name="pdrt-bench")
        self.prompts = PromptBuilder(0, "", target.vocab_size or DEFAULT_VOCAB_SIZE)

    async def open(self) -> ServerInfo:
        ready = await self.client.connect(min(self.target.request_timeout_s, 30.0))
        return ServerInfo(ready.model, ready.max_model_len)

    def set_prompts(self, seed: int, salt: str) -> None:
        self.prompts = PromptBuilder(seed, salt, self.prompts.vocab_size)

    async def send(self, index: int, shape: RequestShape, record: RequestRecord, clock: Clock) -> None:
        params = SamplingParams(temperature=self.target.temperature, max_tokens=shape.output_tokens,
                                ignore_eos=True, seed=index)
        stream = self.client.stream(token_ids=self.prompts.token_ids(index, shape), params=params)
        record.sent(clock())
        try:
            async with stream:
                async for delta in stream:
                    now = clock()
                    if delta.token_ids:
                        record.tokens(len(delta.token_ids), now)
            usage = stream.completion.usage
            record.finish(clock(), usage.completion_tokens if usage else None,
                          usage.prompt_tokens if usage else None, stream.completion.finish_reason)
        except PdrtError as exc:
            record.fail(clock(), exc.code)
        except Exception as exc:  # a benchmark request never takes the run down; its record says what went wrong
            record.fail(clock(), type(exc).__name__)

    async def close(self) -> None:
        await self.client.close()
