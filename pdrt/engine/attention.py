"""Attention over the paged KV pool, plugged into transformers' AttentionInterface.

transformers computes q/k/v and rotary embeddings; this function writes the
step's new keys and values into the pool and attends over each sequence's
blocks. A step packs every scheduled token into one row `[1, T]`: first the
decode tokens (one query each), then the prefill chunks. On the CPU in
float32, all decodes are served by one call of a compiled kernel that reads
their blocks in place (pdrt/engine/cpu_attention.py); elsewhere, by one
batched SDPA call over their gathered blocks with a length mask. Either way no
Python loop runs per decode sequence. Prefill chunks, few and large, get one
SDPA call each. On a GPU in float16 or bfloat16, FlashInfer's paged kernels
serve both instead (pdrt/engine/paged_kernels.py). Step-wide metadata
(slots, tables, gather indices, masks) is built once per step by the model
runner and reused by every layer.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pdrt.engine.cpu_attention import PagedDecodeKernel
from pdrt.engine.kv_pool import KVPool
from pdrt.engine.paged_kernels import PagedKernels

ATTENTION_NAME = "pdrt_paged"


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk of one sequence inside the packed step."""

    start: int  # first row of the chunk in the packed step
    end: int
    context_len: int  # tokens of this sequence already in the pool before the chunk
    block_ids: torch.Tensor | None  # blocks covering context + chunk; None when context_len == 0
    mask: torch.Tensor | None  # additive [chunk, context + chunk] causal mask shifted by context_len


class GatherWorkspace:
    """Reusable buffers for gathered blocks; fresh large allocations each layer would page-fault.

    The decode group and the prefill spans of a step share it: within a layer
    the decode gather is used up before any span gathers, and the runner sizes
    it for the step's largest gather first, so it never moves mid-step.
    """

    def __init__(self, row_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.row_numel, self.dtype, self.device = row_numel, dtype, device
        self.flat = torch.empty(0, dtype=dtype, device=device)

    def buffers(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two contiguous `[num_rows, row_numel]` buffers, for K and V."""
        numel = num_rows * self.row_numel
        if 2 * numel > self.flat.numel():
            self.flat = torch.empty(1 << (2 * numel - 1).bit_length(), dtype=self.dtype, device=self.device)
        rows = (num_rows, self.row_numel)
        return self.flat[:numel].view(rows), self.flat[numel : 2 * numel].view(rows)


@dataclass(slots=True)
class DecodeGather:
    """Where the decode group's blocks are gathered each layer, and the SDPA views of them.

    Built once per step: every layer gathers into the same buffers, so the
    views (and the mask) need no per-layer setup.
    """

    block_ids: torch.Tensor  # [num_decodes * max_blocks], padded with block 0
    k_rows: torch.Tensor  # [num_decodes * max_blocks, block numel], the index_select target
    v_rows: torch.Tensor
    k: torch.Tensor  # [num_decodes, kv_heads, max_blocks * block_size, head_dim] view of k_rows
    v: torch.Tensor
    mask: torch.Tensor | None  # additive [num_decodes, 1, 1, max_blocks * block_size]; None when unpadded

    @classmethod
    def build(cls, workspace: GatherWorkspace, pool: KVPool, block_ids: torch.Tensor, num_decodes: int,
              mask: torch.Tensor | None) -> "DecodeGather":
        layout = pool.layout
        k_rows, v_rows = workspace.buffers(block_ids.numel())
        shape = (num_decodes, -1, layout.num_kv_heads, layout.head_dim)
        return cls(block_ids, k_rows, v_rows, k_rows.view(shape).transpose(1, 2),
                   v_rows.view(shape).transpose(1, 2), mask)


@dataclass(slots=True)
class DecodeTables:
    """The decode group for the compiled kernel, which reads every sequence's blocks where they lie."""

    kernel: PagedDecodeKernel
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with block 0
    lengths: torch.Tensor  # [num_decodes] int64: tokens to attend over, the new one included
    max_len: int


@dataclass(slots=True)
class AttentionMetadata:
    pool: KVPool
    workspace: GatherWorkspace
    slot_mapping: torch.Tensor  # [T] pool slot of each packed token
    num_decodes: int
    decode: DecodeGather | DecodeTables | None
    prefills: list[PrefillSpan]
    kernels: PagedKernels | None = None  # FlashInfer, planned for this step (pdrt/engine/paged_kernels.py)


def _gather(meta: AttentionMetadata, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The given blocks of one layer. (One index_select over a `[2, blocks, ...]` view
    would gather K and V in one call, but is several times slower on CPU.)"""
    k_buf, v_buf = meta.workspace.buffers(block_ids.numel())
    torch.index_select(meta.pool.k_blocks[layer], 0, block_ids, out=k_buf)
    torch.index_select(meta.pool.v_blocks[layer], 0, block_ids, out=v_buf)
    return k_buf, v_buf


def _decode_attention(meta: AttentionMetadata, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """`[num_decodes, heads, head_dim]` for the decode rows, which lead the packed step."""
    gather, b = meta.decode, meta.num_decodes
    if isinstance(gather, DecodeTables):
        layout = meta.pool.layout
        q = query[0, :, :b].transpose(0, 1).contiguous()
        return gather.kernel(q, meta.pool.k_blocks[layer], meta.pool.v_blocks[layer], gather.block_tables,
                             gather.lengths, gather.max_len, layout.block_size, layout.num_kv_heads, scaling)
    torch.index_select(meta.pool.k_blocks[layer], 0, gather.block_ids, out=gather.k_rows)
    torch.index_select(meta.pool.v_blocks[layer], 0, gather.block_ids, out=gather.v_rows)
    kvh = meta.pool.layout.num_kv_heads
    num_heads, d = query.shape[1], query.shape[3]
    # The query heads that share a KV head become that head's query rows, so
    # grouped-query attention needs no copy of K or V.
    q = query[0] if query.shape[2] == b else query[0, :, :b]
    q = q.transpose(0, 1).reshape(b, kvh, num_heads // kvh, d)
    out = F.scaled_dot_product_attention(q, gather.k, gather.v, attn_mask=gather.mask, scale=scaling)
    return out.view(b, num_heads, d)


def _prefill_attention(meta: AttentionMetadata, layer: int, span: PrefillSpan, query: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    q = query[:, :, span.start : span.end]
    if span.block_ids is None:
        k, v = key[:, :, span.start : span.end], value[:, :, span.start : span.end]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        layout = meta.pool.layout
        total = span.context_len + span.end - span.start
        k_buf, v_buf = _gather(meta, layer, span.block_ids)
        k = k_buf.view(1, -1, layout.num_kv_heads, layout.head_dim)[:, :total].transpose(1, 2)
        v = v_buf.view(1, -1, layout.num_kv_heads, layout.head_dim)[:, :total].transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)


def _kernel_attention(kernels: PagedKernels, num_decodes: int, layer: int, q: torch.Tensor) -> torch.Tensor:
    """`q` `[T, heads, head_dim]`, decode rows first -> `[T, heads, head_dim]`, through FlashInfer."""
    if not kernels.has_prefills:
        return kernels.decode(layer, q)
    out = torch.empty_like(q)
    if kernels.has_decodes:
        out[:num_decodes] = kernels.decode(layer, q[:num_decodes])
    out[num_decodes:] = kernels.prefill(layer, q[num_decodes:])
    return out


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention hook: query `[1, H, T, D]`, key/value `[1, KVH, T, D]` -> `[1, T, H, D]`."""
    meta: AttentionMetadata = kwargs["pdrt_attention"]
    layer = module.layer_idx
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    meta.pool.k_slots[layer].index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    meta.pool.v_slots[layer].index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    if meta.kernels is not None:
        return _kernel_attention(meta.kernels, meta.num_decodes, layer, query[0].transpose(0, 1)).unsqueeze(0), None
    if not meta.prefills:
        return _decode_attention(meta, layer, query, scaling).unsqueeze(0), None
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(meta, layer, query, scaling)
    for span in meta.prefills:
        out[span.start : span.end] = _prefill_attention(meta, layer, span, query, key, value, scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
