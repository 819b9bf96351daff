"""AITER's view of a decode batch, built once per step from the engine's block tables.

AITER's MLA decode reads the cache as pages of one token ([num_slots, 1, 1, 576]): request b's
keys are the slots kv_indices[kv_indptr[b]:kv_indptr[b + 1]], its last page holds one token
(kv_last_page_lens), and its query rows are q[qo_indptr[b]:qo_indptr[b + 1]]. AITER's kernels
step through the queries max_seqlen_q rows a request (asm_mla.cu: the query's batch stride is
max_seqlen_q rows), so a batch of unequal query lengths is padded: each request gets the batch's
longest length, its own rows last (a request's rows end at its newest position, which is where
AITER's causal mask aligns them); the padding rows are computed and dropped.

The slots depend on the block size, a property of the cache rather than of the metadata: they
are resolved on the first layer's call and kept for the step's other layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from jackfield.contracts.attention import AttentionMetadata, AttentionMetadataBuilder

LAYOUT_KEY = "rocm_aiter_decode_layout"


@dataclass(frozen=True)
class AiterDecodeLayout:
    query_len: int  # max_seqlen_q: every request's rows in the padded batch
    qo_indptr: torch.Tensor  # [B + 1] int32: b * query_len
    kv_indptr: torch.Tensor  # [B + 1] int32: where request b's keys start in kv_indices
    kv_last_page_lens: torch.Tensor  # [B] int32: 1 (a page is one token)
    padded_rows: torch.Tensor | None  # [T] int64: each query row's row in the padded batch; None: no padding
    num_keys: int  # the keys of every request: kv_indices' length
    max_seq_len: int
    # the metadata tensors it was built from (a copy of the metadata with others builds its own)
    block_table: torch.Tensor = field(repr=False)
    seq_lens: torch.Tensor = field(repr=False)
    query_start_loc: torch.Tensor = field(repr=False)
    _kv_indices: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def serves(self, metadata: AttentionMetadata) -> bool:
        return (self.block_table is metadata.block_table and self.seq_lens is metadata.seq_lens
                and self.query_start_loc is metadata.query_start_loc)

    def kv_indices(self, block_size: int) -> torch.Tensor:
        """[num_keys] int32: each request's slots, position by position, for caches of `block_size`."""
        if block_size not in self._kv_indices:
            self._kv_indices[block_size] = self._slots(block_size)
        return self._kv_indices[block_size]

    def _slots(self, block_size: int) -> torch.Tensor:
        # Every (request, position) pair is scattered to its place in the packed list; positions
        # past a request's length land on one spare entry past the end, which is dropped. No sync.
        pos = torch.arange(self.max_seq_len, device=self.block_table.device)
        slots = self.block_table[:, pos // block_size].long() * block_size + pos % block_size
        starts = self.kv_indptr[:-1, None].long()
        place = torch.where(pos < self.seq_lens[:, None], starts + pos, self.num_keys)
        packed = slots.new_empty(self.num_keys + 1).scatter_(0, place.flatten(), slots.flatten())
        return packed[: self.num_keys].to(torch.int32)


def build_layout(metadata: AttentionMetadata) -> AiterDecodeLayout:
    """The layout of a decode batch (every request a decode)."""
    device, num_reqs = metadata.seq_lens.device, metadata.num_reqs
    query_len = metadata.max_query_len
    q_lens_cpu = metadata.query_start_loc_cpu.diff()
    kv_indptr = torch.zeros(num_reqs + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = metadata.seq_lens.cumsum(0)
    padded_rows = None
    if not bool((q_lens_cpu == query_len).all()):
        num_rows = int(metadata.query_start_loc_cpu[-1])
        qsl = metadata.query_start_loc.long()
        q_lens = qsl.diff()
        req = torch.repeat_interleave(torch.arange(num_reqs, device=device), q_lens, output_size=num_rows)
        row_in_req = torch.arange(num_rows, device=device) - qsl[req]
        padded_rows = req * query_len + (query_len - q_lens[req]) + row_in_req
    return AiterDecodeLayout(
        query_len=query_len,
        qo_indptr=torch.arange(num_reqs + 1, dtype=torch.int32, device=device) * query_len,
        kv_indptr=kv_indptr,
        kv_last_page_lens=torch.ones(num_reqs, dtype=torch.int32, device=device),
        padded_rows=padded_rows,
        num_keys=int(metadata.seq_lens_cpu.sum()),
        max_seq_len=metadata.max_seq_len,
        block_table=metadata.block_table,
        seq_lens=metadata.seq_lens,
        query_start_loc=metadata.query_start_loc,
    )


def layout_for(metadata: AttentionMetadata) -> AiterDecodeLayout:
    """The step's layout from the builder, or one built for this call (a caller that skipped the
    builder, such as a direct attend; the engine builds once per step)."""
    layout = metadata.extra.get(LAYOUT_KEY)
    if isinstance(layout, AiterDecodeLayout) and layout.serves(metadata):
        return layout
    return build_layout(metadata)


class RocmAiterMetadataBuilder(AttentionMetadataBuilder):
    """Builds the AITER layout of a decode batch; prefill metadata passes through (prefill rows
    take MLAImpl's expanded form). Every build makes new tensors and keeps nothing: a capture-time
    build never touches what a run-time build made. Whether a batch is causal is the metadata's own
    flag (`AttentionMetadata.causal`), read at each call, never state of the builder."""

    def build(self, common: AttentionMetadata, for_capture: bool = False) -> AttentionMetadata:
        if common.num_reqs == 0 or common.num_decodes != common.num_reqs:
            return common
        return common.replace(extra={**common.extra, LAYOUT_KEY: build_layout(common)})
