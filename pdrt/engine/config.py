"""Engine configuration: one small dataclass, validated once."""

from dataclasses import dataclass

from pdrt.errors import InvalidRequestError

DEFAULT_KV_CACHE_BYTES = 1 << 30
# Smaller chunks cost prefill throughput (each chunk re-gathers its context),
# larger ones stall the decode steps that share a batch with them for longer
# (scripts/bench_chunk_size.py measures both). Colocated deployments that weigh
# TPOT over TTFT can lower it.
DEFAULT_PREFILL_CHUNK = 512
# A draft's stable tokens start being prefilled once this many are waiting
# (most short prompts are typed and sent before, and cost nothing ahead);
# after that, every DEFAULT_MIN_DRAFT_STEP more: smaller steps re-gather the
# draft's context for little work, larger ones leave more to do after Enter.
DEFAULT_MIN_DRAFT_CHUNK = 128
DEFAULT_MIN_DRAFT_STEP = 16


@dataclass(slots=True)
class EngineConfig:
    """What one engine (one model replica) needs to know.

    The KV pool is sized by `num_blocks` when given, else by
    `kv_cache_memory_bytes`. `max_model_len` defaults to the model's context.
    `hash_seed` keys the prefix-cache hash; every process that exchanges KV
    must use the same value.
    """

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES  # 0 on a GPU: what its memory leaves (pdrt/devices.py)
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    prompt_batch_tokens: int | None = None  # prompts one by one, batched within this many tokens (Scheduler)
    enable_prefix_caching: bool = True
    hash_seed: int = 0
    num_threads: int | None = None
    min_draft_chunk: int = DEFAULT_MIN_DRAFT_CHUNK
    min_draft_step: int = DEFAULT_MIN_DRAFT_STEP
    max_draft_tokens: int | None = None  # per draft; None: the context length
    max_draft_pool_fraction: float = 0.5
    gpu_memory_utilization: float = 0.9  # of the GPU, shared by `gpu_sharing` workers, when the pool is sized by it
    gpu_sharing: int = 1
    # Speculative decoding (pdrt/engine/speculation.py): "prompt_lookup", "off", or a draft model's checkpoint.
    speculate: str = "prompt_lookup"

    def __post_init__(self) -> None:
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_prefill_chunk_size": self.max_prefill_chunk_size,
            "min_draft_chunk": self.min_draft_chunk,
            "min_draft_step": self.min_draft_step,
        }
        for name, value in positive.items():
            if value < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {value}")
        if self.kv_cache_memory_bytes < (0 if self.device.startswith("cuda") else 1):
            raise InvalidRequestError(f"kv_cache_memory_bytes must be >= 1 (0 on a GPU: sized from its memory), "
                                      f"got {self.kv_cache_memory_bytes}")
        if self.prompt_batch_tokens is not None and self.prompt_batch_tokens < 0:
            raise InvalidRequestError(f"prompt_batch_tokens must be >= 0, got {self.prompt_batch_tokens}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidRequestError(f"num_threads must be >= 1, got {self.num_threads}")
        if not (0.0 <= self.max_draft_pool_fraction <= 1.0):
            raise InvalidRequestError(f"max_draft_pool_fraction must be in [0, 1], got {self.max_draft_pool_fraction}")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 1:
            raise InvalidRequestError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype}")
