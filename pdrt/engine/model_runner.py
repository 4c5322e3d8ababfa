"""Runs one packed engine step through the transformers model over the paged pool."""

import torch

from pdrt.engine.attention import AttentionMetadata, GatherWorkspace, PrefillSpan
from pdrt.engine.kv_pool import KVPool
from pdrt.engine.scheduler import ScheduledBatch
from pdrt.engine.sequence import Sequence


class ModelRunner:
    """Builds a step's inputs and attention metadata, runs the model, returns the logits to sample."""

    def __init__(self, model: torch.nn.Module, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.tensor.device
        layout = pool.layout
        self.block_size = layout.block_size
        self.workspace = GatherWorkspace(layout.block_size * layout.num_kv_heads * layout.head_dim,
                                         layout.dtype, self.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare_decodes(self, seqs: list[Sequence], input_ids: list[int], positions: list[int],
                        slots: list[int]) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """Inputs of the decode group, and its padded block gather with a length mask."""
        bs = self.block_size
        lengths = []
        for seq in seqs:
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            lengths.append(pos + 1)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        padded = []
        for seq in seqs:
            padded.extend(seq.block_table)
            padded.extend([0] * (max_blocks - len(seq.block_table)))
        mask = None
        if any(n != max_blocks * bs for n in lengths):
            cols = torch.arange(max_blocks * bs, device=self.device)
            mask = (cols.unsqueeze(0) < self._tensor(lengths).unsqueeze(1)).view(len(seqs), 1, 1, -1)
        return self._tensor(padded), max_blocks, mask

    def prepare_prefill(self, seq: Sequence, n: int, start_row: int, input_ids: list[int],
                        positions: list[int], slots: list[int]) -> PrefillSpan:
        ctx = seq.num_computed_tokens
        input_ids.extend(seq.token_ids[ctx : ctx + n])
        positions.extend(range(ctx, ctx + n))
        slots.extend(self._slots(seq, ctx, ctx + n))
        if ctx == 0:
            return PrefillSpan(start_row, start_row + n, 0, None, None)
        total = ctx + n
        num_blocks = -(-total // self.block_size)
        rows = torch.arange(n, device=self.device).unsqueeze(1)
        cols = torch.arange(total, device=self.device).unsqueeze(0)
        mask = cols <= rows + ctx
        return PrefillSpan(start_row, start_row + n, ctx, self._tensor(seq.block_table[:num_blocks]), mask)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_block_ids, decode_max_blocks, decode_mask = self._tensor([]), 0, None
        if batch.decodes:
            decode_block_ids, decode_max_blocks, decode_mask = self.prepare_decodes(
                batch.decodes, input_ids, positions, slots)
        spans = []
        for seq, n in batch.prefills:
            spans.append(self.prepare_prefill(seq, n, len(input_ids), input_ids, positions, slots))
        meta = AttentionMetadata(self.pool, self.workspace, self._tensor(slots), len(batch.decodes),
                                 decode_block_ids, decode_max_blocks, decode_mask, spans)
        return self._tensor(input_ids).unsqueeze(0), self._tensor(positions).unsqueeze(0), meta

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits `[num_sampled, vocab]` for `batch.sample_seqs()`, in that order."""
        input_ids, positions, meta = self.prepare(batch)
        keep, row = [], 0
        for seq, n in batch.items():
            row += n
            if seq.needs_sample_after(n):
                keep.append(row - 1)
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                         logits_to_keep=self._tensor(keep), pdrt_attention=meta)
        return out.logits[0]
