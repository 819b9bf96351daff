"""Merging partial attention results computed over disjoint key sets (DCP, chunked prefill)."""

from __future__ import annotations

import torch


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partials: out [T, H, D] (any float dtype), lse [T, H] float32 natural log.

    Exact for empty partials: where one side's lse is -inf the result is the other side, bit for
    bit; both -inf give out 0 and lse -inf. Never NaN for finite inputs.
    """
    if out_a.shape != out_b.shape or out_a.dim() != 3:
        raise ValueError(f"outputs must both be [T, H, D], got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if out_a.dtype != out_b.dtype:
        raise ValueError(f"outputs differ in dtype: {out_a.dtype} vs {out_b.dtype}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {lse.dtype}")
        if lse.shape != out_a.shape[:2]:
            raise ValueError(f"{name} must be [T, H] = {tuple(out_a.shape[:2])}, got {tuple(lse.shape)}")
    empty_a, empty_b = lse_a == float("-inf"), lse_b == float("-inf")
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(empty_a & empty_b, 0.0, top)  # avoid -inf - -inf
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    lse = top + torch.log(total)  # log(0) = -inf for rows empty on both sides
    norm = torch.where(total > 0, total, 1.0)
    merged = (out_a.float() * (w_a / norm)[..., None] + out_b.float() * (w_b / norm)[..., None]).to(
        out_a.dtype
    )
    # Select instead of weighting so an empty side (whatever its out holds) contributes nothing.
    out = torch.where(empty_b[..., None], out_a, torch.where(empty_a[..., None], out_b, merged))
    out = torch.where(
        (empty_a & empty_b)[..., None], torch.zeros((), dtype=out.dtype, device=out.device), out
    )
    lse = torch.where(empty_b, lse_a, torch.where(empty_a, lse_b, lse))
    return out, lse
