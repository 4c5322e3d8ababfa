"""The paged KV pool of one worker: one tensor, sliced per layer."""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: Any, block_size: int, dtype: torch.dtype) -> "KVLayout":
        """The layout of a transformers model config's KV cache."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_bytes(self, budget: int) -> int:
        return budget // self.bytes_per_block


class KVPool:
    """`[layers, 2, blocks, block_size, kv_heads, head_dim]`, K at index 0 and V at 1.

    A block of one layer is contiguous, so copying a block between pools (or
    gathering a sequence's blocks for attention) moves whole
    `block_size * kv_heads * head_dim` runs. The tensor may be supplied by the
    caller (shared memory, a CUDA IPC mapping); otherwise it is allocated here.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu",
                 storage: torch.Tensor | None = None) -> None:
        shape = self.shape_for(layout, num_blocks)
        if storage is None:
            storage = torch.zeros(shape, dtype=layout.dtype, device=device)
        elif tuple(storage.shape) != shape or storage.dtype != layout.dtype:
            raise ValueError(f"KV storage must be {shape} {layout.dtype}, got {tuple(storage.shape)} {storage.dtype}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.tensor = storage
        num_slots = num_blocks * layout.block_size
        # Per-layer views with one row per token slot, for writing new KV.
        self.k_slots = [storage[i, 0].view(num_slots, layout.num_kv_heads, layout.head_dim)
                        for i in range(layout.num_layers)]
        self.v_slots = [storage[i, 1].view(num_slots, layout.num_kv_heads, layout.head_dim)
                        for i in range(layout.num_layers)]
        # Per-layer views with one row per block, for gathering whole blocks.
        self.k_blocks = [storage[i, 0].view(num_blocks, -1) for i in range(layout.num_layers)]
        self.v_blocks = [storage[i, 1].view(num_blocks, -1) for i in range(layout.num_layers)]

    @staticmethod
    def shape_for(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
        return (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the given blocks of every layer: `[layers, 2, len(block_ids), ...]`."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return self.tensor.index_select(2, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        self.tensor.index_copy_(2, index, data.to(self.tensor.device))
