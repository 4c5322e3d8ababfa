"""Runs one packed engine step through the model's forward (pdrt/engine/decoder.py) over the paged pool."""

from array import array

import torch

from pdrt.engine import cpu_attention
from pdrt.engine.attention import AttentionMetadata, DecodeGather, DecodeTables, GatherWorkspace, PrefillSpan
from pdrt.engine.decoder import Decoder
from pdrt.engine.kv_pool import KVPool
from pdrt.engine.paged_kernels import PagedKernels, page_table
from pdrt.engine.scheduler import ScheduledBatch


class ModelRunner:
    """Builds a step's inputs and attention metadata, runs the model, returns the logits to sample.

    Every integer input of a step (token ids, positions, slots, rows to keep,
    decode lengths and block tables) goes to the device in a single tensor:
    on a small model the per-tensor overhead of many small copies is a
    visible share of a decode step.
    """

    def __init__(self, decoder: Decoder, pool: KVPool, max_model_len: int) -> None:
        self.decoder = decoder
        self.pool = pool
        self.device = pool.tensor.device
        self.dtype = pool.tensor.dtype
        # Masked scores get the dtype's most negative value, as in transformers: -inf
        # would make a fully masked row NaN, and multiplying it by a False mask gives NaN too.
        self.mask_value = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        layout = pool.layout
        self.block_size = layout.block_size
        self.workspace = GatherWorkspace(layout.block_size * layout.num_kv_heads * layout.head_dim,
                                         layout.dtype, self.device)
        self.decode_kernel = cpu_attention.load() if cpu_attention.supports(self.device, self.dtype,
                                                                            layout.head_dim) else None
        self.kernels = PagedKernels.load(pool, decoder.num_heads)  # FlashInfer on a GPU
        # Sliced for length masks. A decode's padded length may round up past
        # max_model_len to a whole block.
        self.columns = torch.arange(max_model_len + self.block_size, device=self.device)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Model inputs `[1, T]` (ids, positions), the rows whose logits to keep, and attention metadata.

        Decode rows are built per token; a prefill chunk's positions and
        slots are computed with tensor ops from its block table, so no Python
        loop runs per prompt token.
        """
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        lengths: list[int] = []
        tables: list[int] = []
        decodes = batch.decodes
        max_blocks = max((len(s.block_table) for s in decodes), default=0)
        # A decode is a row per token: its own, then any proposals it verifies (pdrt/engine/speculation.py),
        # each attending to the rows before it as a later decode would.
        for seq in decodes:
            pos = seq.num_computed_tokens
            table = seq.block_table
            padded = table + [0] * (max_blocks - len(table))
            first = len(ids)
            for p, token in enumerate([seq.token_ids[pos], *seq.proposal], start=pos):
                ids.append(token)
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                lengths.append(p + 1)
                tables.extend(padded)
            if seq.needs_sample_after(1):
                keep.extend(range(first, len(ids)))
        num_decodes = len(ids)
        if self.kernels is not None:
            self._plan_kernels(batch, tables, lengths, max_blocks)
        span_info = []
        for seq, n in batch.prefills:
            ctx = seq.num_computed_tokens
            num_blocks = -(-(ctx + n) // bs)
            if seq.needs_sample_after(n):
                keep.append(len(ids) + n - 1)
            span_info.append((len(ids), n, ctx, len(tables), num_blocks))
            ids.extend(seq.token_ids[ctx : ctx + n])
            tables.extend(seq.block_table[:num_blocks])
        packed = torch.frombuffer(array("q", ids + positions + slots + keep + lengths + tables), dtype=torch.long)
        ids_t, pos_t, slots_t, keep_t, lengths_t, tables_t = packed.to(self.device).split(
            [len(ids), num_decodes, num_decodes, len(keep), num_decodes, len(tables)])
        # Size the gather workspace for the step's largest gather once, before any view into it is taken.
        # (A chunk with no context attends over its own fresh K/V and gathers nothing; nor do the kernels,
        # which read blocks where they lie.)
        gathers = self.kernels is None
        decode_gather = 0 if self.decode_kernel or not gathers else num_decodes * max_blocks
        self.workspace.buffers(max([decode_gather] + [nb for _, _, ctx, _, nb in span_info if ctx and gathers]))
        decode = None
        if num_decodes and gathers and self.decode_kernel:
            decode = DecodeTables(self.decode_kernel, tables_t[: num_decodes * max_blocks].view(num_decodes, -1),
                                  lengths_t, max(lengths))
        elif num_decodes and gathers:
            mask = None
            if any(n != max_blocks * bs for n in lengths):
                # An additive float mask: SDPA's CPU kernel would convert a boolean one in every layer.
                padding = self.columns[: max_blocks * bs] >= lengths_t.unsqueeze(1)
                mask = (padding * self.mask_value).view(num_decodes, 1, 1, -1)
            decode = DecodeGather.build(self.workspace, self.pool, tables_t[: num_decodes * max_blocks],
                                        num_decodes, mask)
        spans = []
        if span_info:
            all_positions, all_slots = [pos_t], [slots_t]
            for start, n, ctx, at, num_blocks in span_info:
                block_ids = tables_t[at : at + num_blocks]
                all_positions.append(self.columns[ctx : ctx + n])
                all_slots.append((block_ids.unsqueeze(1) * bs + self.columns[:bs]).view(-1)[ctx : ctx + n])
                if gathers:
                    spans.append(self._span(start, n, ctx, block_ids))
            pos_t, slots_t = torch.cat(all_positions), torch.cat(all_slots)
        meta = AttentionMetadata(self.pool, self.workspace, slots_t, num_decodes, decode, spans, self.kernels)
        return ids_t.unsqueeze(0), pos_t.unsqueeze(0), keep_t, meta

    def _plan_kernels(self, batch: ScheduledBatch, tables: list[int], lengths: list[int], max_blocks: int) -> None:
        """Plan FlashInfer's step: the decode rows (padded tables, one per row) and the prefill chunks."""
        rows = [tables[i * max_blocks : (i + 1) * max_blocks] for i in range(len(lengths))]
        decode = page_table(rows, lengths, self.block_size) if lengths else None
        prefill = None
        if batch.prefills:
            prefill = page_table([seq.block_table for seq, _ in batch.prefills],
                                 [seq.num_computed_tokens + n for seq, n in batch.prefills], self.block_size)
        self.kernels.plan(decode, prefill, [n for _, n in batch.prefills])

    def _span(self, start: int, n: int, ctx: int, block_ids: torch.Tensor) -> PrefillSpan:
        if not ctx:
            return PrefillSpan(start, start + n, 0, None, None)
        rows = self.columns[:n].unsqueeze(1)
        cols = self.columns[: ctx + n].unsqueeze(0)
        return PrefillSpan(start, start + n, ctx, block_ids, (cols > rows + ctx) * self.mask_value)

    @torch.inference_mode()
    def forward_rows(self, num_rows: int) -> None:
        """A forward pass over `num_rows` new tokens in the pool's first slots, outside any request: what a
        step of that many rows costs. Only before the pool holds anything."""
        ids = torch.zeros(1, num_rows, dtype=torch.long, device=self.device)
        positions = self.columns[:num_rows].unsqueeze(0)
        meta = AttentionMetadata(self.pool, self.workspace, self.columns[:num_rows], 0, None,
                                 [PrefillSpan(0, num_rows, 0, None, None)])
        self.decoder(ids, positions, 0, meta)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits `[rows, vocab]` for the rows that sample: every row of each decode that samples (its token,
        then its proposals'), then the last row of each prompt that ends in this step."""
        input_ids, positions, keep, meta = self.prepare(batch)
        if keep.numel() == input_ids.shape[1]:
            keep = 0  # every row is sampled: all are kept without an index copy
        return self.decoder(input_ids, positions, keep, meta)
