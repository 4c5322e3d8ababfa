"""Runs one packed engine step through the transformers model over the paged pool."""

import torch

from pdrt.engine.attention import AttentionMetadata, GatherWorkspace, PrefillSpan
from pdrt.engine.kv_pool import KVPool
from pdrt.engine.scheduler import ScheduledBatch


class ModelRunner:
    """Builds a step's inputs and attention metadata, runs the model, returns the logits to sample.

    Every integer input of a step (token ids, positions, slots, rows to keep,
    decode lengths and block tables) goes to the device in a single tensor:
    on a small model the per-tensor overhead of many small copies is a
    visible share of a decode step.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.tensor.device
        layout = pool.layout
        self.block_size = layout.block_size
        self.workspace = GatherWorkspace(layout.block_size * layout.num_kv_heads * layout.head_dim,
                                         layout.dtype, self.device)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Model inputs `[1, T]` (ids, positions), the rows whose logits to keep, and attention metadata."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        lengths: list[int] = []
        tables: list[int] = []
        decodes = batch.decodes
        max_blocks = max((len(s.block_table) for s in decodes), default=0)
        for row, seq in enumerate(decodes):
            pos = seq.num_computed_tokens
            table = seq.block_table
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            lengths.append(pos + 1)
            tables.extend(table)
            tables.extend([0] * (max_blocks - len(table)))
            if seq.needs_sample_after(1):
                keep.append(row)
        span_info = []
        for seq, n in batch.prefills:
            ctx, table = seq.num_computed_tokens, seq.block_table
            start = len(ids)
            ids.extend(seq.token_ids[ctx : ctx + n])
            positions.extend(range(ctx, ctx + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(ctx, ctx + n))
            if seq.needs_sample_after(n):
                keep.append(start + n - 1)
            num_blocks = -(-(ctx + n) // bs) if ctx else 0
            span_info.append((start, n, ctx, len(tables), num_blocks))
            tables.extend(table[:num_blocks])
        num_tokens, num_keep, num_decodes = len(ids), len(keep), len(decodes)
        packed = torch.tensor(ids + positions + slots + keep + lengths + tables, dtype=torch.long,
                              device=self.device)
        ids_t, pos_t, slots_t, keep_t, lengths_t, tables_t = packed.split(
            [num_tokens, num_tokens, num_tokens, num_keep, num_decodes, len(tables)])
        decode_mask = None
        if num_decodes and any(n != max_blocks * bs for n in lengths):
            cols = torch.arange(max_blocks * bs, device=self.device)
            decode_mask = (cols < lengths_t.unsqueeze(1)).view(num_decodes, 1, 1, -1)
        spans = [self._span(start, n, ctx, tables_t[at : at + nb] if ctx else None)
                 for start, n, ctx, at, nb in span_info]
        meta = AttentionMetadata(self.pool, self.workspace, slots_t, num_decodes,
                                 tables_t[: num_decodes * max_blocks], max_blocks, decode_mask, spans)
        return ids_t.unsqueeze(0), pos_t.unsqueeze(0), keep_t, meta

    def _span(self, start: int, n: int, ctx: int, block_ids: torch.Tensor | None) -> PrefillSpan:
        if not ctx:
            return PrefillSpan(start, start + n, 0, None, None)
        rows = torch.arange(n, device=self.device).unsqueeze(1)
        cols = torch.arange(ctx + n, device=self.device).unsqueeze(0)
        return PrefillSpan(start, start + n, ctx, block_ids, cols <= rows + ctx)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits `[num_sampled, vocab]` for `batch.sample_seqs()`, in that order."""
        input_ids, positions, keep, meta = self.prepare(batch)
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep,
                         pdrt_attention=meta)
        return out.logits[0]
