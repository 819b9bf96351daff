"""DeepSeek mixture of experts: grouped top-k routing, routed experts, shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jackfield.distributed.cp_common import parallel_state
from jackfield.distributed.tensor_parallel import local_size
from jackfield.models.hf_config import DeepseekArch
from jackfield.models.layers import GatedMLP


def route(
    logits: torch.Tensor, arch: DeepseekArch, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k]).

    V3 (sigmoid, noaux_tc): groups ranked by the sum of their top-2 biased scores, the
    top `topk_group` groups kept, top-k experts by biased score, weights from unbiased scores.
    V2 (softmax): plain top-k, or group_limited_greedy (groups ranked by their best score).
    """
    num_tokens, num_experts = logits.shape
    k, groups = arch.num_experts_per_tok, arch.n_group
    if arch.moe_scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
        group_scores = choice.view(num_tokens, groups, -1).topk(2, dim=-1).values.sum(-1)
        masked_fill = float("-inf")
    else:
        scores = logits.softmax(dim=-1)
        choice = scores
        group_scores = scores.view(num_tokens, groups, -1).max(dim=-1).values
        masked_fill = 0.0
    if arch.topk_method != "greedy":
        dropped = torch.ones_like(group_scores, dtype=torch.bool)
        dropped.scatter_(1, group_scores.topk(arch.topk_group, dim=-1).indices, False)
        choice = choice.view(num_tokens, groups, -1).masked_fill(dropped.unsqueeze(-1), masked_fill)
        choice = choice.view(num_tokens, num_experts)
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if arch.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * arch.routed_scaling_factor, ids


class Experts(nn.Module):
    """E gated MLPs stacked: w13 [E, 2I, D] (gate ‖ up), w2 [E, D, I].

    Rows (token, choice) are sorted by expert. On CUDA (bf16) one grouped matmul per weight runs
    every expert with the group offsets on the device: no host sync, a fixed number of kernels.
    Elsewhere a loop runs one matmul pair per expert that has rows (its counts read on the host,
    which costs nothing on the CPU). One token on the CPU (batch-1 decode) skips the sort and the
    scatter: its k experts run in turn and are summed.

    Under tensor parallelism a rank holds experts [first, first + num_experts) and returns their
    part of each token's sum (the decoder layer adds the ranks' parts): a choice of another
    rank's expert gets weight 0 and the id num_experts, which sorts after every held expert, so
    no matmul runs for it.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
        first: int | None = None,
    ) -> None:
        """`first`: the first expert this rank holds (None: it holds all of them)."""
        super().__init__()
        self.first = first
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), False
        )
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), False)
        self._ends: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        held = None
        if self.first is not None:
            count = self.w13.shape[0]
            local = ids - self.first
            held = (local >= 0) & (local < count)
            ids, weights = torch.where(held, local, count), torch.where(held, weights, 0)
        if x.shape[0] == 1 and x.device.type == "cpu":
            return self._one_token(x, weights, ids)
        num_tokens, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        # Each expert's end row in the sorted order: no bincount, whose CUDA kernel syncs on the
        # host, so a decode step stays capturable in a CUDA graph.
        ends = torch.searchsorted(flat[order], self._expert_ends(ids), out_int32=True)
        rows = x[order // k]
        out = self._grouped(rows, ends) if use_grouped_mm(rows) else self._looped(rows, ends.tolist())
        if held is not None:  # rows of other ranks' experts were never computed: zero, not garbage
            out = out.masked_fill(~held.flatten()[order].unsqueeze(1), 0.0)
        # Back to (token, choice) order, then each token's k outputs weighted and summed in float32
        # (as the reference combines) by one batched product: no atomics, so a token's sum does
        # not depend on the batch's other tokens.
        per_choice = torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, k, out.shape[-1])
        return torch.bmm(weights.float().unsqueeze(1), per_choice.float()).squeeze(1).to(x.dtype)

    def _expert_ends(self, ids: torch.Tensor) -> torch.Tensor:
        """1..E as ids' dtype and device (made once): searching them in the sorted ids gives
        each expert's end row."""
        if self._ends is None or self._ends.device != ids.device or self._ends.dtype != ids.dtype:
            self._ends = torch.arange(1, self.w13.shape[0] + 1, device=ids.device, dtype=ids.dtype)
        return self._ends

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A single token (batch-1 decode): its k experts run directly, no sort or scatter; their
        outputs are weighted and summed in float32 in choice order and rounded once, as the
        batched combine does."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert, weight in zip(ids[0].tolist(), weights[0].float().tolist(), strict=True):
            if expert == self.w13.shape[0]:  # another rank's expert
                continue
            gate, up = F.linear(x, self.w13[expert]).chunk(2, dim=-1)
            out.add_(F.linear(F.silu(gate) * up, self.w2[expert]).float(), alpha=weight)
        return out.to(x.dtype)

    def _grouped(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """`ends` (int32): each expert's end row, the grouped matmul's offsets."""
        gate, up = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=ends)

    def _looped(self, rows: torch.Tensor, ends: list[int]) -> torch.Tensor:
        out = torch.empty_like(rows)
        start = 0
        for expert, end in enumerate(ends):
            if end == start:
                continue
            segment = rows[start:end]
            gate, up = F.linear(segment, self.w13[expert]).chunk(2, dim=-1)
            out[start:end] = F.linear(F.silu(gate) * up, self.w2[expert])
            start = end
        return out


def use_grouped_mm(rows: torch.Tensor) -> bool:
    """torch._grouped_mm's fast kernels: CUDA, bf16 (Hopper and newer)."""
    return grouped_mm_supported(rows.device, rows.dtype)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether experts on `device` in `dtype` run as grouped matmuls (no host sync); elsewhere the
    per-expert loop reads the group sizes on the host, which a CUDA graph cannot record."""
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


class DeepseekMoE(nn.Module):
    def __init__(self, arch: DeepseekArch, dtype: torch.dtype) -> None:
        super().__init__()
        num_experts = int(arch.n_routed_experts or 0)
        if num_experts % arch.n_group:
            raise ValueError(f"n_routed_experts {num_experts} is not divisible by n_group {arch.n_group}")
        self.arch = arch
        # The router runs in float32 whatever the activation dtype (as the reference does).
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(
            torch.empty(num_experts, arch.hidden_size, dtype=torch.float32), False
        )
        if arch.moe_scoring == "sigmoid":
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), False
            )
        tp = parallel_state()
        if num_experts % tp.tp_size:
            raise ValueError(f"{num_experts} routed experts cannot be split over "
                             f"parallel.tensor_parallel_size {tp.tp_size}")
        # Each rank holds a run of whole experts and a column/row part of the shared ones.
        local = num_experts // tp.tp_size
        self.experts = Experts(local, arch.hidden_size, arch.moe_intermediate_size, dtype,
                               first=tp.tp_rank * local if tp.tp_size > 1 else None)
        self.shared_experts = (
            GatedMLP(arch.hidden_size, local_size(arch.moe_intermediate_size * arch.n_shared_experts), dtype)
            if arch.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routed and shared experts' output (this rank's part under tensor parallelism)."""
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = route(logits, self.arch, getattr(self.gate, "e_score_correction_bias", None))
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
