"""Tensor parallelism's pieces: how a dimension is split between ranks, and the collectives the
layers call (each is the identity in one process, so the single-process path runs no collective
and makes no copy).

Column-parallel linears (q/k/v, gate ‖ up, q_b, kv_b) keep their output rows `part(out)`;
row-parallel ones (o_proj, down_proj) keep their input columns and leave partial sums that the
decoder layer adds up with one `all_reduce`. The vocabulary is split by rows of the embedding and
the head (`part(vocab)`, the last part shorter when the ranks do not divide it); every rank
gathers the whole logits, so sampling sees the same numbers on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from jackfield.distributed.cp_common import parallel_state


def part(size: int, index: int, parts: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `size` is cut into `parts` parts of ceil(size / parts)
    (the last ones shorter, or empty, when `parts` does not divide `size`)."""
    step = -(-size // parts)
    return min(index * step, size), min((index + 1) * step, size)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel ranks (x itself in one process)."""
    groups = parallel_state()
    if groups.tp_group is None:
        return x
    dist.all_reduce(x, group=groups.tp_group)
    return x


def embed(input_ids: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The embedding of input_ids from this rank's rows of the table (`part(vocab_size)`): each
    rank looks up the ids it holds, zero elsewhere, and the ranks' rows are added up."""
    groups = parallel_state()
    if groups.tp_group is None:
        return F.embedding(input_ids, weight)
    start, stop = part(vocab_size, groups.tp_rank, groups.tp_size)
    held = (input_ids >= start) & (input_ids < stop)
    rows = F.embedding(torch.where(held, input_ids - start, 0), weight)
    return all_reduce(rows.masked_fill(~held.unsqueeze(-1), 0.0))


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab_size] logits from each rank's [N, part(vocab_size)] columns (the same tensor on
    every rank); `local` itself in one process."""
    groups = parallel_state()
    if groups.tp_group is None:
        return local
    width = -(-vocab_size // groups.tp_size)
    padded = F.pad(local, (0, width - local.shape[-1])).contiguous()
    shards = [torch.empty_like(padded) for _ in range(groups.tp_size)]
    dist.all_gather(shards, padded, group=groups.tp_group)
    return torch.cat(shards, dim=-1)[:, :vocab_size]


@dataclass(frozen=True)
class HeadSplit:
    """One attention layer's heads on this rank. Query heads are split over every rank; under
    DCP a rank attends the query heads of its whole DCP group (its head group), so its KV cache
    holds that group's KV heads: KV heads are split over the head groups, each replicated on the
    groups that share it when there are fewer KV heads than groups (as vLLM does)."""

    num_heads: int  # query heads this rank projects and outputs (H / tp)
    num_attend_heads: int  # query heads its attention attends (H / head groups)
    num_kv_heads: int  # KV heads its cache holds
    kv_index: int  # its KV heads are part kv_index of kv_parts of the checkpoint's
    kv_parts: int


def head_split(num_heads: int, num_kv_heads: int) -> HeadSplit:
    """This rank's heads of a layer of `num_heads` query and `num_kv_heads` KV heads (MLA: the
    latent cache is one KV "head" every rank holds whole)."""
    groups = parallel_state()
    tp, head_groups = groups.tp_size, groups.num_head_groups
    if num_heads % tp:
        raise ValueError(f"{num_heads} attention heads cannot be split over "
                         f"parallel.tensor_parallel_size {tp}")
    if num_kv_heads >= head_groups:
        if num_kv_heads % head_groups:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over {head_groups} head groups "
                             "(tensor_parallel_size / dcp_size)")
        kv_parts, kv_index = head_groups, groups.head_group
    else:
        if head_groups % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {head_groups} head "
                             "groups (tensor_parallel_size / dcp_size)")
        kv_parts, kv_index = num_kv_heads, groups.head_group // (head_groups // num_kv_heads)
    return HeadSplit(num_heads // tp, num_heads // head_groups, num_kv_heads // kv_parts, kv_index, kv_parts)


def local_size(size: int) -> int:
    """This rank's part of a dimension split over every rank (column/row-parallel linears);
    the ranks must divide it."""
    tp = parallel_state().tp_size
    if size % tp:
        raise ValueError(f"a dimension of {size} cannot be split over parallel.tensor_parallel_size {tp}")
    return size // tp
