"""Splitting one step's metadata into its decode and prefill halves (cheap slicing, no copies).

The engine divides a batch by role in one place (jackfield.models.attention.StepContextBuilder),
which calls this before each half goes through its role's metadata builder."""

from __future__ import annotations

from jackfield.contracts.attention import AttentionMetadata


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
    decode = _slice(metadata, 0, nd, is_decode=True) if nd else None
    prefill = _slice(metadata, nd, num_reqs, is_decode=False) if nd < num_reqs else None
    return decode, prefill


def _slice(md: AttentionMetadata, r0: int, r1: int, *, is_decode: bool) -> AttentionMetadata:
    qsl_cpu = md.query_start_loc_cpu[r0 : r1 + 1]
    t0, t1 = int(qsl_cpu[0]), int(qsl_cpu[-1])
    qsl = md.query_start_loc[r0 : r1 + 1]
    if t0:
        qsl, qsl_cpu = qsl - t0, qsl_cpu - t0
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
