"""Decode context parallelism (DCP): each request's KV cache split between the ranks of a DCP
group, every rank attending its own part for the whole group's query heads, the parts merged by
their log-sum-exp.

Placement (`DCPLayout`): with W ranks and interleave I, the token at position o goes to rank
(o // I) % W, at local offset (o // (W * I)) * I + o % I of that rank's copy of the request's
blocks. With I dividing the block size B, the request's block j covers positions
[j * B * W, (j + 1) * B * W) on every rank at once, B of them on each: the block manager (the
same on every rank) counts blocks of B * W tokens, and a rank's pool of B-token blocks holds
1/W of every request.

A layer's attention (`attend_mla`, `attend_mha`): write the rows' KV this rank holds (other
slots are -1) and all-gather the queries over the DCP group's heads. Then:
- decode rows: a row at position p sees the local keys at offsets < `local_len(p + 1)` (the
  positions <= p this rank holds, a prefix of its local offsets), so each is a one-row request of
  that length (`dcp_metadata`); each rank attends its keys returning (out, LSE) (MLA: then W_UV,
  per head), the LSEs are all-gathered, each rank scales its output by exp(lse_i - lse_total)
  (exactly 0 where it held no key: a rank with none of a row's keys gives (0, -inf); NaN and
  +inf LSEs count as -inf, so 0 * NaN never appears), and a reduce-scatter over heads hands each
  rank the merged output of its own heads;
- prefill requests (as vLLM): each one's context is all-gathered from the ranks into one
  temporary block (`gather_context`), the prefill impl attends it as in one process for the
  group's heads, and each rank keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from jackfield.attention.mla import MLAImpl
from jackfield.contracts.attention import AttentionImpl, AttentionMetadata
from jackfield.distributed.cp_common import ParallelGroups


@dataclass(frozen=True)
class DCPLayout:
    """Where each token's KV lives among the `size` ranks of a DCP group (module docstring)."""

    rank: int
    size: int
    interleave: int = 1

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions // self.interleave) % self.size

    def local_offset(self, positions: torch.Tensor) -> torch.Tensor:
        """The offset of each position in its owner's copy of the request's blocks."""
        i = self.interleave
        return (positions // (self.size * i)) * i + positions % i

    def local_len(self, lengths: torch.Tensor) -> torch.Tensor:
        """How many of the positions [0, length) this rank holds."""
        i, cycle = self.interleave, self.size * self.interleave
        return (lengths // cycle) * i + (lengths % cycle - self.rank * i).clamp(0, i)


DCP_ROWS = "dcp_rows"  # the key of a DCP step's `DCPRows` in its AttentionMetadata.extra


@dataclass(frozen=True)
class DCPPrefill:
    """A DCP step's prefill requests (the rows after the decodes): each one's context gathered
    from every rank into one temporary block per request (`gather_context`), over which the
    prefill impl attends as in one process, for the DCP group's heads."""

    metadata: AttentionMetadata  # global positions; block j of request j's context (the prefill builder's)
    block_size: int  # the temporary block: the longest context, rounded up to the cache's block size
    local_slots: torch.Tensor  # [B, L] int64: this rank's slots of each request's local offsets
    gather_index: torch.Tensor  # [B, block_size] int64: each position's record among the gathered ones


@dataclass(frozen=True)
class DCPRows:
    """What a DCP step's attention needs beyond the decode rows' metadata: the local slot of
    every row's KV (-1 where another rank holds it); the decode rows (first) that see a key here
    (the metadata describes only those: a row with no local key is no request to a backend); the
    prefill requests, if any."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_rows: int
    attending: torch.Tensor | None  # [n] int64 decode rows with local keys; None: every one
    num_attending: int
    prefill: DCPPrefill | None


def dcp_metadata(layout: DCPLayout, block_size: int, tables: torch.Tensor, row_req: torch.Tensor,
                 positions: torch.Tensor, query_start: torch.Tensor, num_decodes: int,
                 h2d: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                 build_prefill: Callable[[AttentionMetadata], AttentionMetadata]) -> AttentionMetadata:
    """The step's metadata on this rank, from host tensors: `tables` [requests, blocks] (block j
    covering B * W positions), each row's request and position, where each request's rows start
    (the first `num_decodes` are decodes). Every decode row that sees a local key is a one-row
    decode over the keys it sees; `extra[DCP_ROWS]` holds every row's slot and the prefill
    requests' plan. With no decode row, the metadata is the prefill requests'."""
    offsets = layout.local_offset(positions)
    slots = tables[row_req, offsets // block_size] * block_size + offsets % block_size
    slots = torch.where(layout.owner(positions) == layout.rank, slots, -1)
    every_slot = h2d(slots, torch.int64)
    decode_rows = int(query_start[num_decodes])
    prefill = None
    if decode_rows < positions.numel():
        request_lens = (positions[query_start[1:] - 1] + 1)[num_decodes:]
        prefill = _prefill_plan(layout, block_size, tables[num_decodes:],
                                query_start[num_decodes:] - decode_rows, request_lens, slots[decode_rows:],
                                h2d, build_prefill)
    seq_lens = layout.local_len(positions[:decode_rows] + 1).to(torch.int32)
    row_req = row_req[:decode_rows]
    seen = seq_lens > 0
    num_attending = int(seen.sum())
    attending, attending_slots = None, every_slot[:decode_rows]
    if 0 < num_attending < decode_rows:
        rows = seen.nonzero().squeeze(1)
        attending, attending_slots = h2d(rows, torch.int64), h2d(slots[rows], torch.int64)
        row_req, seq_lens = row_req[rows], seq_lens[rows]
    rows_info = DCPRows(every_slot, decode_rows, attending, num_attending, prefill)
    if not decode_rows:
        assert prefill is not None
        return prefill.metadata.replace(extra={**prefill.metadata.extra, DCP_ROWS: rows_info})
    n = seq_lens.numel()
    decode_start = torch.arange(n + 1, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=h2d(decode_start, torch.int32), seq_lens=h2d(seq_lens, torch.int32),
        block_table=h2d(tables[row_req], torch.int32), slot_mapping=attending_slots,
        query_start_loc_cpu=decode_start, seq_lens_cpu=seq_lens, max_query_len=1,
        max_seq_len=int(seq_lens.max()), num_decodes=n, num_decode_tokens=n, causal=True,
        extra={DCP_ROWS: rows_info})


def _prefill_plan(layout: DCPLayout, block_size: int, tables: torch.Tensor, query_start: torch.Tensor,
                  seq_lens: torch.Tensor, slots: torch.Tensor,
                  h2d: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                  build_prefill: Callable[[AttentionMetadata], AttentionMetadata]) -> DCPPrefill:
    """The prefill requests' plan (host tensors of those requests only; `slots`: their rows')."""
    requests = seq_lens.numel()
    longest = int(seq_lens.max())
    width = -(-longest // block_size) * block_size
    # Rank 0 holds the most of any length: every rank's offsets fit below its count.
    local_width = int(DCPLayout(0, layout.size, layout.interleave).local_len(torch.tensor(longest)))
    local = torch.arange(local_width)
    table_index = (local // block_size).clamp(max=tables.shape[1] - 1)
    local_slots = tables[:, table_index] * block_size + local % block_size  # past a request's own: unread
    position = torch.arange(width)
    # The gathered records are [rank, request, local offset]; a position past its request's
    # length points at record 0 (the prefill never reads it).
    source = layout.owner(position) * requests * local_width + layout.local_offset(position)
    gather_index = source[None, :] + (torch.arange(requests) * local_width)[:, None]
    gather_index = torch.where(position[None, :] < seq_lens[:, None], gather_index, 0)
    metadata = AttentionMetadata(
        query_start_loc=h2d(query_start, torch.int32), seq_lens=h2d(seq_lens, torch.int32),
        block_table=h2d(torch.arange(requests)[:, None], torch.int32),
        slot_mapping=h2d(slots, torch.int64),
        query_start_loc_cpu=query_start.to(torch.int32), seq_lens_cpu=seq_lens.to(torch.int32),
        max_query_len=int(query_start.diff().max()), max_seq_len=longest, causal=True)
    return DCPPrefill(build_prefill(metadata), width, h2d(local_slots, torch.int64),
                      h2d(gather_index, torch.int64))


def gather_context(cache: torch.Tensor, plan: DCPPrefill, mla: bool, groups: ParallelGroups) -> torch.Tensor:
    """The prefill requests' whole contexts from every DCP rank, as a temporary cache of one block
    of `plan.block_size` per request (MLA [B, S, L+R]; MHA [2, B, S, H_kv, D]), in the cache's
    dtype."""
    if mla:
        records = cache.flatten(0, 1)[plan.local_slots]  # [B, L, L+R]
    else:
        records = cache.flatten(1, 2)[:, plan.local_slots].movedim(0, 2)  # [B, L, 2, H_kv, D]
    w = groups.dcp_size
    # An fp8 cache's records travel as bytes (not every collective library reduces fp8 types).
    raw = records.contiguous()
    raw = raw.view(torch.uint8) if raw.element_size() == 1 else raw
    gathered = raw.new_empty((w * raw.shape[0], *raw.shape[1:]))
    dist.all_gather_into_tensor(gathered, raw, group=groups.dcp_group)
    context = gathered.view(records.dtype).flatten(0, 1)[plan.gather_index]  # [B, S, ...] by position
    return context if mla else context.movedim(2, 0).contiguous()


def _attend_local(impl: AttentionImpl, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                  kv_scale: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [T, H, width], LSE [T, H]) of every decode row over this rank's keys: (0, -inf) for
    rows that see none here."""
    rows: DCPRows = metadata.extra[DCP_ROWS]  # type: ignore[assignment]
    if rows.attending is None and rows.num_attending:
        part = impl.attend(query, cache, metadata, kv_scale=kv_scale, return_lse=True)
        return part.out, part.lse
    out = query.new_zeros(*query.shape[:2], width)
    lse = torch.full(query.shape[:2], float("-inf"), device=query.device)
    if rows.num_attending:
        part = impl.attend(query[rows.attending], cache, metadata, kv_scale=kv_scale, return_lse=True)
        if part.lse is None:
            raise ValueError("decode context parallel needs the attention backend's LSE (return_lse)")
        out[rows.attending], lse[rows.attending] = part.out, part.lse
    return out, lse


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """NaN and +inf LSEs (a kernel's empty or broken row) as -inf: such a partial counts as empty."""
    return torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)


def neutralize_empty_sparse_rows(out: torch.Tensor, lse: torch.Tensor,
                                 topk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose top-k is all -1 (nothing selected) as (0, -inf), whatever the kernel returned."""
    empty = (topk_indices < 0).all(dim=-1)[:, None]
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))


def partial_weights(own: torch.Tensor, every: torch.Tensor) -> torch.Tensor:
    """exp(own - lse_total) [T, H] float32, the weight of one rank's partial output, from its LSE
    `own` [T, H] and every rank's `every` [W, T, H] (all sanitized): exactly 0 where own is -inf,
    and 0 where no rank saw a key."""
    top = every.amax(dim=0)
    top = torch.where(top == float("-inf"), 0.0, top)  # no -inf - -inf
    total = torch.log(torch.exp(every - top).sum(dim=0)) + top  # -inf where every rank is empty
    return torch.where(own == float("-inf"), 0.0, torch.exp(own - total))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The merged output [T, H, D] float32 of partials over disjoint key sets, outs [W, T, H, D]
    and lses [W, T, H], as the ranks compute it together (each scales its own, the sum is the
    reduce-scatter's): one process's form of `merge_over_ranks`, for tests and checks."""
    every = sanitize_lse(lses.float())
    merged = weighted(outs[0], partial_weights(every[0], every))
    for rank in range(1, outs.shape[0]):
        merged += weighted(outs[rank], partial_weights(every[rank], every))
    return merged


def weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] * weight [T, H] in float32, exactly 0 where the weight is (0 * NaN too)."""
    scaled = out.float() * weight[..., None]
    return scaled.masked_fill_(weight[..., None] == 0, 0.0)


def gather_heads(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """[T, h, D] on each rank of the DCP group -> [T, W * h, D]: rank i's heads i-th."""
    w, t = groups.dcp_size, x.shape[0]
    gathered = x.new_empty((w * t, *x.shape[1:]))
    dist.all_gather_into_tensor(gathered, x.contiguous(), group=groups.dcp_group)
    return gathered.view(w, *x.shape).transpose(0, 1).flatten(1, 2)


def merge_over_ranks(out: torch.Tensor, lse: torch.Tensor | None, groups: ParallelGroups) -> torch.Tensor:
    """This rank's partial attention out [T, W * h, D] and LSE [T, W * h] over its keys -> the
    merged output of its own h heads [T, h, D], in out's dtype."""
    if lse is None:
        raise ValueError("decode context parallel needs the attention backend's LSE (return_lse)")
    w = groups.dcp_size
    own = sanitize_lse(lse.float())
    every = own.new_empty((w * own.shape[0], *own.shape[1:]))
    dist.all_gather_into_tensor(every, own.contiguous(), group=groups.dcp_group)
    every = every.view(w, *own.shape)
    scaled = weighted(out, partial_weights(own, every))
    t, heads, d = scaled.shape
    # rank i's heads i-th, flat over dim 0 as the collective takes them
    by_rank = scaled.view(t, w, heads // w, d).transpose(0, 1).reshape(w * t, heads // w, d)
    merged = scaled.new_empty(t, heads // w, d)
    dist.reduce_scatter_tensor(merged, by_rank, group=groups.dcp_group)
    return merged.to(out.dtype)


def attend_mla(decode: MLAImpl, prefill: MLAImpl, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               cache: torch.Tensor, metadata: AttentionMetadata, kv_scale: torch.Tensor | None,
               groups: ParallelGroups) -> torch.Tensor:
    """MLA under DCP: q [T, h, N+R] (this rank's heads), kv_c and k_pe [T, ...] -> [T, h, V].
    The impls serve the DCP group's W * h heads (their W_UK / W_UV are theirs). Decode rows: W_UV
    is applied to every gathered head before the merge (the merge is linear per head), so the
    reduce-scatter moves V values a head, not the latent's L (128 against 512 for DeepSeek-V3).
    Prefill rows: the expanded form over the gathered context; each rank keeps its own heads."""
    rows: DCPRows = metadata.extra[DCP_ROWS]  # type: ignore[assignment]
    decode.write_kv(cache, rows.slot_mapping, kv_c, k_pe, kv_scale)
    every = gather_heads(q, groups)
    d, out = rows.decode_rows, []
    if d:
        latent, lse = _attend_local(decode, decode.absorb_query(every[:d]), cache, metadata, kv_scale,
                                    decode.layer.kv_lora_rank)
        assert decode.W_UV is not None, "MLA weights are loaded before the first step"
        values = torch.bmm(latent.float().transpose(0, 1), decode.W_UV).transpose(0, 1)  # [d, W * h, V]
        out.append(merge_over_ranks(values, lse, groups).to(q.dtype))
    if rows.prefill is not None:
        context = gather_context(cache, rows.prefill, True, groups)
        expanded = prefill.prefill(every[d:], context, rows.prefill.metadata, kv_scale=kv_scale)
        out.append(_own_heads(expanded, q.shape[1], groups))
    return out[0] if len(out) == 1 else torch.cat(out)


def attend_mha(decode: AttentionImpl, prefill: AttentionImpl, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
               kv_scale: torch.Tensor | None, groups: ParallelGroups) -> torch.Tensor:
    """MHA/GQA under DCP: q [T, h, D] (this rank's heads), k and v [T, H_kv, D] (its head
    group's) -> [T, h, D]. Decode rows merge the ranks' parts; prefill rows attend the gathered
    context and keep this rank's heads."""
    rows: DCPRows = metadata.extra[DCP_ROWS]  # type: ignore[assignment]
    decode.write_kv(cache, rows.slot_mapping, k, v, kv_scale)
    every = gather_heads(q, groups)
    d, out = rows.decode_rows, []
    if d:
        partial, lse = _attend_local(decode, every[:d], cache, metadata, kv_scale, decode.layer.head_size)
        out.append(merge_over_ranks(partial, lse, groups))
    if rows.prefill is not None:
        context = gather_context(cache, rows.prefill, False, groups)
        whole = prefill.attend(every[d:], context, rows.prefill.metadata, kv_scale=kv_scale).out
        out.append(_own_heads(whole, q.shape[1], groups))
    return out[0] if len(out) == 1 else torch.cat(out)


def _own_heads(x: torch.Tensor, heads: int, groups: ParallelGroups) -> torch.Tensor:
    """This rank's `heads` of the DCP group's, x [T, W * heads, ...]."""
    return x[:, groups.dcp_rank * heads : (groups.dcp_rank + 1) * heads]
