"""A step's metadata divided by role: the one rule that decides whether a KV cache group's batch
is divided (`GroupMetadataBuilder`) and the slicing into decode and prefill halves
(`slice_requests`, which a model drafter's chain also slices its drafts' rows with).

The engine builds every step's metadata through GroupMetadataBuilder (one per KV cache group, in
jackfield.models.attention.StepContextBuilder), and so does the conformance kit's forward test.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    BatchPart,
)

EVERY_ROW = slice(None)


class GroupMetadataBuilder:
    """One KV cache group's metadata builders, and the one place its batch is divided by role.

    It divides the batch when the roles name different backends, or when the group's layers are
    MLA (kv_lora_rank > 0): an MLA impl computes decode rows in the absorbed form and prefill rows
    in the expanded one, so each role's rows come with their own metadata. An MHA group served by
    one backend gets one metadata for the whole batch.
    """

    def __init__(self, decode: type[AttentionBackend], prefill: type[AttentionBackend],
                 layers: Sequence[AttentionLayerSpec]) -> None:
        self.by_role = prefill is not decode or any(layer.kv_lora_rank > 0 for layer in layers)
        # A divided group has a builder per role even on one backend: a builder may reuse its
        # buffers per build (as vLLM's), so one builder never builds both halves of a step.
        self.decode: AttentionMetadataBuilder = decode.metadata_builder()
        self.prefill: AttentionMetadataBuilder = prefill.metadata_builder() if self.by_role else self.decode

    def build(self, common: AttentionMetadata, for_capture: bool = False) -> tuple[BatchPart, ...]:
        """The parts of the group's batch (decodes first), each built by its role's builder."""
        if not self.by_role:
            return (BatchPart(EVERY_ROW, self.decode.build(common, for_capture), None),)
        # A step of one role is its own half: one build, no slicing (decode-only steps are the
        # hot path, and every CUDA-graph capture).
        if common.num_decodes == common.num_reqs:
            return (BatchPart(EVERY_ROW, self.decode.build(common, for_capture), "decode"),)
        if common.num_decodes == 0:
            return (BatchPart(EVERY_ROW, self.prefill.build(common, for_capture), "prefill"),)
        decode, prefill = split_decode_prefill(common)
        assert decode is not None and prefill is not None  # both roles have requests
        nd = common.num_decode_tokens
        return (BatchPart(slice(0, nd), self.decode.build(decode, for_capture), "decode"),
                BatchPart(slice(nd, None), self.prefill.build(prefill, for_capture), "prefill"))


def split_decode_prefill(
    metadata: AttentionMetadata,
) -> tuple[AttentionMetadata | None, AttentionMetadata | None]:
    """(decode half, prefill half); a half with no requests is None.

    Decodes are the first `num_decodes` requests and `num_decode_tokens` rows. Each half is
    self-contained (its query_start_loc starts at 0) and has its own copy of `extra`, so what one
    half's builder or impls keep there is not the other's.
    """
    num_reqs, nd, ndt = metadata.num_reqs, metadata.num_decodes, metadata.num_decode_tokens
    if not 0 <= nd <= num_reqs or int(metadata.query_start_loc_cpu[nd]) != ndt:
        raise ValueError(
            f"num_decodes={nd}, num_decode_tokens={ndt} disagree with query_start_loc "
            f"{metadata.query_start_loc_cpu.tolist()}"
        )
    decode = slice_requests(metadata, 0, nd, is_decode=True) if nd else None
    prefill = slice_requests(metadata, nd, num_reqs, is_decode=False) if nd < num_reqs else None
    return decode, prefill


def slice_requests(md: AttentionMetadata, r0: int, r1: int, *, is_decode: bool) -> AttentionMetadata:
    """Requests r0 .. r1 - 1 of `md` as metadata of their own (query_start_loc from 0; views
    where they can be, so a slice costs no device work when its offsets repeat the batch's first:
    a batch of one-row decodes, such as a draft chain's rows sliced per draft)."""
    qsl_cpu = md.query_start_loc_cpu[r0 : r1 + 1]
    t0, t1 = int(qsl_cpu[0]), int(qsl_cpu[-1])
    qsl = md.query_start_loc[r0 : r1 + 1]
    if t0:
        qsl_cpu = qsl_cpu - t0
        first = md.query_start_loc_cpu[: r1 - r0 + 1]
        qsl = md.query_start_loc[: r1 - r0 + 1] if torch.equal(first, qsl_cpu) else qsl - t0
    seq_lens_cpu = md.seq_lens_cpu[r0:r1]
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=md.seq_lens[r0:r1],
        block_table=md.block_table[r0:r1],
        slot_mapping=md.slot_mapping[t0:t1],
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=int(qsl_cpu.diff().max()),
        max_seq_len=int(seq_lens_cpu.max()),
        num_decodes=r1 - r0 if is_decode else 0,
        num_decode_tokens=t1 - t0 if is_decode else 0,
        causal=md.causal,
        extra=dict(md.extra),
    )
