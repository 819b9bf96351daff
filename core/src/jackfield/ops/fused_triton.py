"""One-kernel versions of a dense decoder layer's small elementwise ops, for CUDA.

In a bf16 decode step of a 16-layer Llama-shaped model at batch 64, PyTorch's eager ops launch
about 14 elementwise kernels a layer beside the 4 matmuls and the attention (RoPE alone is five:
the upcast, two products, a roll and the downcast), each 2-3 us on the H200 even inside a CUDA
graph: ~0.5 ms of a 2 ms step (benchmarks/RESULTS.md, "decode kernel count"). Each function here
is one kernel that computes what its PyTorch counterpart in models/layers.py computes, rounding
where it rounds (a bf16 intermediate stays a bf16 intermediate), so the float32 parity tests and
the bf16 accuracy bounds hold unchanged; core/tests/ops/test_fused_triton.py pins each against
that counterpart and a float64 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jackfield.ops.launch import DirectLauncher


@triton.jit
def _rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, heads, stride_xt, stride_xh,
                 R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    t, hb = tl.program_id(0), tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    rotated = (r + R // 2) % R  # roll by half: out[i] = x[i] cos[i] + x[(i + R/2) % R] sin[i]
    mask = (h[:, None] < heads) & (r[None, :] < R)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * R + r, mask=r < R, other=0.0)
    sin = tl.load(sin_ptr + pos * R + r, mask=r < R, other=0.0)
    row = x_ptr + t.to(tl.int64) * stride_xt + h[:, None] * stride_xh
    x = tl.load(row + r[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rolled = tl.load(row + rotated[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * cos[None, :] + x_rolled * sin[None, :]
    out_row = out_ptr + (t.to(tl.int64) * heads + h[:, None]) * R
    tl.store(out_row + r[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + d, mask=d < D, other=0.0).to(tl.float32)
    normed = (x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * D + d, (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=d < D)


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_delta, multiplier, eps,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + d, mask=d < D, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + t.to(tl.int64) * stride_delta + d, mask=d < D, other=0.0)
    if SCALED:  # delta * multiplier, rounded to the activation dtype before the sum (as scaled())
        delta = (delta.to(tl.float32) * multiplier).to(sum_ptr.dtype.element_ty)
    total = (x + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + t.to(tl.int64) * D + d, total, mask=d < D)
    s = total.to(tl.float32)
    normed = (s * tl.math.rsqrt(tl.sum(s * s, 0) / D + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * D + d, (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=d < D)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    t, b = tl.program_id(0), tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    row = x_ptr + t.to(tl.int64) * stride_x
    gate = tl.load(row + i, mask=i < inter, other=0.0).to(tl.float32)
    up = tl.load(row + inter + i, mask=i < inter, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * inter + i, (silu * up).to(out_ptr.dtype.element_ty), mask=i < inter)


_rope = DirectLauncher(_rope_kernel)
_rms_norm = DirectLauncher(_rms_norm_kernel)
_silu_mul = DirectLauncher(_silu_mul_kernel)
_add_rms_norm = DirectLauncher(_add_rms_norm_kernel)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, H, R] (the last dim contiguous) rotated at `positions` [T] with RotaryEmbedding's
    tables cos, sin [max_positions, R] float32 (half-split layout; sin holds [-sin ‖ sin]):
    a new contiguous [T, H, R] tensor in x's dtype, computed in float32."""
    t, heads, r = x.shape
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == r
    out = torch.empty((t, heads, r), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_r = triton.next_power_of_2(r)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_r))
    _rope((t, triton.cdiv(heads, block_h)), x, out, cos, sin, positions, heads, x.stride(0), x.stride(1),
          R=r, BLOCK_H=block_h, BLOCK_R=block_r)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * F.rms_norm(x, eps=eps) for a 16-bit x [T, D] (rows may be strided): normalized in
    float32, rounded to x's dtype, then scaled by the weight and rounded again, as that pair does."""
    t, d = x.shape
    assert x.stride(-1) == 1
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t:
        _rms_norm((t,), x, weight, out, x.stride(0), eps, D=d, BLOCK_D=triton.next_power_of_2(d))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta * multiplier, weight * F.rms_norm(that sum)) for 16-bit x, delta [T, D] of one
    dtype (rows may be strided): a residual add and the norm after it, each rounded as the PyTorch
    ops round (the scaled delta, the sum, the normalized sum, its product with the weight)."""
    t, d = x.shape
    assert x.stride(-1) == 1 and delta.stride(-1) == 1 and delta.shape == x.shape and delta.dtype == x.dtype
    total = torch.empty((t, d), dtype=x.dtype, device=x.device)
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t:
        _add_rms_norm((t,), x, delta, weight, total, out, x.stride(0), delta.stride(0), multiplier, eps, D=d,
                      BLOCK_D=triton.next_power_of_2(d), SCALED=multiplier != 1)
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up [T, 2I] = [gate ‖ up] (rows may be strided): the SiLU rounded
    to the input's dtype before the product, as the two PyTorch ops round."""
    t, two_i = gate_up.shape
    assert gate_up.stride(-1) == 1 and two_i % 2 == 0
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul((t, triton.cdiv(inter, block)), gate_up, out, gate_up.stride(0), inter, BLOCK=block)
    return out
