"""Attention on a GPU through FlashInfer's paged kernels, which read the pool's blocks where they lie.

A layer's K and V in the pool, `[blocks, block_size, kv_heads, head_dim]`,
are FlashInfer's NHD pages (a page is a block), passed as a (K, V) tuple.
Each step plans once, and every layer runs what was planned:

* the decode rows with `BatchDecodeWithPagedKVCacheWrapper`, one query
  each, as the CPU kernel takes them (a sequence verifying proposed tokens
  has a row per token, each with its own length);
* the prefill chunks, with whatever context they have in the pool (a
  cached prefix, earlier chunks), with `BatchPrefillWithPagedKVCacheWrapper`,
  causal, its mask aligned to the end of each sequence's context.

The step's new K and V are in the pool before either runs, as on the CPU.
FlashInfer is maintained for exactly this layout and is what vLLM and
SGLang use on NVIDIA GPUs. It serves float16 and bfloat16 pools on CUDA.
Elsewhere (float32, the CPU, FlashInfer not installed) attention stays with
torch's SDPA over gathered blocks (pdrt/engine/attention.py).
"""

from dataclasses import dataclass

import structlog
import torch

from pdrt.engine.kv_pool import KVPool

log = structlog.get_logger(__name__)

WORKSPACE_BYTES = 128 << 20  # per wrapper, as FlashInfer's examples size it
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class PageTable:
    """FlashInfer's description of which pages each query group reads: `indices[indptr[i]:indptr[i + 1]]`,
    the last of them holding `last_page_len[i]` tokens."""

    indptr: list[int]
    indices: list[int]
    last_page_len: list[int]


def page_table(tables: list[list[int]], lengths: list[int], block_size: int) -> PageTable:
    """The pages of sequences whose KV is the first `lengths[i]` tokens of block table `tables[i]`."""
    indptr, indices, last = [0], [], []
    for table, length in zip(tables, lengths, strict=True):
        num_pages = -(-length // block_size)
        indices += table[:num_pages]
        indptr.append(len(indices))
        last.append(length - (num_pages - 1) * block_size)
    return PageTable(indptr, indices, last)


class PagedKernels:
    """The FlashInfer wrappers of one engine, planned once per step."""

    def __init__(self, flashinfer, pool: KVPool, num_heads: int) -> None:
        device = pool.tensor.device
        self.pool, self.num_heads = pool, num_heads
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD",
            use_tensor_cores=num_heads > pool.layout.num_kv_heads)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD")
        self.has_decodes = self.has_prefills = False

    @classmethod
    def load(cls, pool: KVPool, num_heads: int) -> "PagedKernels | None":
        """The kernels where they serve this pool (float16 or bfloat16 on CUDA, FlashInfer installed)."""
        if pool.tensor.device.type != "cuda" or pool.layout.dtype not in KERNEL_DTYPES:
            return None
        try:
            import flashinfer
        except ImportError:
            log.warning("FlashInfer is not installed: attention on this GPU gathers blocks for torch's SDPA "
                        "(pip install flashinfer-python)")
            return None
        try:  # once, on a 1-token sequence in block 0 (the pool holds nothing yet): a kernel that cannot be
            # built or run on this GPU falls back here, at start-up, never under a request
            kernels = cls(flashinfer, pool, num_heads)
            one = PageTable([0, 1], [0], [1])
            kernels.plan(one, one, [1])
            q = torch.zeros(1, num_heads, pool.layout.head_dim, dtype=pool.layout.dtype, device=pool.tensor.device)
            kernels.decode(0, q)
            kernels.prefill(0, q)
            torch.cuda.synchronize()
        except Exception as exc:  # whatever FlashInfer raises, SDPA still serves
            log.warning("FlashInfer's kernels do not run here: attention gathers blocks for torch's SDPA",
                        error=repr(exc)[:300])
            return None
        log.info("attention through FlashInfer's paged kernels", dtype=str(pool.layout.dtype))
        return kernels

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.pool.tensor.device)

    def plan(self, decode: PageTable | None, prefill: PageTable | None, chunk_lengths: list[int]) -> None:
        """Plan the step: its decode rows' pages, and its prefill chunks' (of `chunk_lengths` query tokens)."""
        layout = self.pool.layout
        shape = (self.num_heads, layout.num_kv_heads, layout.head_dim, layout.block_size)
        self.has_decodes, self.has_prefills = decode is not None, prefill is not None
        if decode is not None:
            self.decode_wrapper.plan(self._tensor(decode.indptr), self._tensor(decode.indices),
                                     self._tensor(decode.last_page_len), *shape, pos_encoding_mode="NONE",
                                     q_data_type=layout.dtype, kv_data_type=layout.dtype)
        if prefill is not None:
            qo_indptr = [0]
            for n in chunk_lengths:
                qo_indptr.append(qo_indptr[-1] + n)
            self.prefill_wrapper.plan(self._tensor(qo_indptr), self._tensor(prefill.indptr),
                                      self._tensor(prefill.indices), self._tensor(prefill.last_page_len), *shape,
                                      causal=True, q_data_type=layout.dtype, kv_data_type=layout.dtype)

    def _pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.tensor[layer, 0], self.pool.tensor[layer, 1]

    def decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """`q` `[rows, heads, head_dim]` of the decode rows -> their attention, the same shape."""
        return self.decode_wrapper.run(q.contiguous(), self._pages(layer))

    def prefill(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """`q` `[chunk tokens, heads, head_dim]` of every prefill chunk, in order -> their attention."""
        return self.prefill_wrapper.run(q.contiguous(), self._pages(layer))
