"""What an engine hands back to its caller."""

import msgspec


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The tokens one request produced since its previous output.

    `finish_reason` is a `FinishReason` value once the request has ended.
    `stop_reason` names the stop string or stop token that ended it.
    `kv_block_ids` is set for a prefill-only request that was not finished by
    its first token: the blocks holding its prompt KV, kept until released.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: int | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_block_ids: list[int] | None = None


class ImportReservation(msgspec.Struct, array_like=True, gc=False):
    """Blocks reserved for a prompt's KV coming from another worker.

    The first `num_cached_blocks` already hold that prefix here (prefix-cache
    hits); only the rest need to be filled before `commit_import`.
    """

    block_ids: list[int]
    num_cached_blocks: int
