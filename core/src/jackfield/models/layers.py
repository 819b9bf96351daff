"""Building blocks shared by model families: linear, RMSNorm, RoPE, gated MLP, and the pieces
of a decoder laid out as transformers' *ForCausalLM.

Parameters are created empty (the checkpoint loader writes every one of them and checks it).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from jackfield.contracts.attention import StepContext
from jackfield.contracts.model import ModelFamily

# From this many rows on, a float32 product on the CPU reads oneDNN's blocked copy of the weight:
# on the 2-core Xeon VM (torch 2.13, one thread, each layer's weights read from memory) it took
# 0.6-0.8x MKL's time at 4-64 rows (MKL's GEMM slows from 4 rows; SmolLM2's 49152 x 576 head 0.4x
# at 8), the same at 512; below 4 rows MKL's product is the faster one.
PACKED_MIN_ROWS = 4
# ...and from 2 rows for an LM head (SmolLM2's tied 49152 x 576; 2-core AVX2 EPYC VM, one
# thread): at 2 rows oneDNN 8.6 ms against MKL's 11.1 (column-major copy) and 18.7 (plain); at one
# row MKL's product on the column-major copy 5.4 ms against oneDNN's 8.1 (2 threads: 5.5 / 4.9).
HEAD_PACKED_MIN_ROWS = 2


@functools.cache
def fused_cuda_ops() -> ModuleType | None:
    """ops/fused_triton (one kernel where PyTorch launches several) for CUDA tensors, or None
    where Triton is missing (the PyTorch ops then serve, as on the CPU)."""
    try:
        from jackfield.ops import fused_triton
    except ImportError:
        return None
    return fused_triton


def _fused_for(x: torch.Tensor, dims: int) -> ModuleType | None:
    """The fused kernels for a 16-bit CUDA activation of `dims` dimensions with contiguous rows,
    else None."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == dims and x.stride(-1) == 1:
        return fused_cuda_ops()
    return None


def cpu_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a CPU float32 weight [out, in] (None for other weights)."""
    cpu_float32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not cpu_float32 or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] as a view of its transpose's contiguous copy (same values and shape)."""
    return weight.detach().t().contiguous().t()


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None,
           packed_min_rows: int = PACKED_MIN_ROWS) -> torch.Tensor:
    """x W^T; through `packed` (cpu_packed_weight(W)) for `packed_min_rows` rows or more."""
    if packed is not None and x.numel() >= packed_min_rows * x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return F.linear(x, weight)


class Linear(nn.Module):
    """y = x W^T, with W [out, in] (the Hugging Face layout), no bias, no init. `weight`: a
    parameter to share instead (a head tied to the embedding). `pack_for_cpu` (after loading)
    adds oneDNN's copy of a CPU float32 weight, as many bytes again, for products of
    `packed_min_rows` rows or more, and stores a wide one (more outputs than inputs) column-major
    for the fewer rows: a shared one as a copy, so the embedding's rows stay contiguous."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 weight: nn.Parameter | None = None, packed_min_rows: int = PACKED_MIN_ROWS) -> None:
        super().__init__()
        self.packed_min_rows = packed_min_rows
        self.shared = weight is not None
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight = weight
        self.packed: torch.Tensor | None = None
        self.few_rows_weight: torch.Tensor | None = None  # None: the weight itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = self.weight if self.few_rows_weight is None else self.few_rows_weight
        return linear(x, few_rows, self.packed, self.packed_min_rows)

    def pack_for_cpu(self) -> None:
        self.packed = cpu_packed_weight(self.weight)
        out_features, in_features = self.weight.shape
        if self.packed is None or out_features <= in_features:
            return
        # MKL's product of a few rows streams a column-major weight faster when it is wide (2-core
        # AVX2 EPYC VM, one thread, one row: SmolLM2's gate_up 3072 x 576 0.38 ms against 0.56
        # row-major, qkv 960 x 576 0.16 against 0.19), not when it is narrow (down 576 x 1536:
        # 0.27 against 0.22).
        if self.shared:
            self.few_rows_weight = column_major(self.weight)
        else:
            self.weight.data = column_major(self.weight)


def pack_cpu_linears(model: nn.Module) -> None:
    """Every loaded `Linear` of `model` packs its weight (CPU float32 ones; the others keep none)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor; x itself for a factor of 1 (Llama's multipliers), one op fewer a call."""
    return x if factor == 1 else x * factor


def select_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x's rows `rows` (an index tensor on x's device), or x itself when rows is None."""
    return x if rows is None else x[rows]


class RMSNorm(nn.Module):
    """Normalizes in float32, scales in the activation dtype (as the DeepSeek reference does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # nothing to round: one call scales too
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        fused = _fused_for(x, 2)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        # The fused kernel normalizes a 16-bit input in float32 and rounds once, as the reference's
        # x.float() -> normalize -> .to(dtype) does; the weight then scales the rounded value.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor, multiplier: float = 1.0,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + scaled(delta, multiplier), its norm): a residual add and the norm that reads the sum,
        one kernel for 16-bit CUDA activations."""
        fused = _fused_for(x, 2) if _fused_for(delta, 2) is not None and delta.dtype == x.dtype else None
        if fused is not None:
            return fused.add_rms_norm(x, delta, self.weight, self.eps, multiplier)
        total = x + scaled(delta, multiplier)
        return total, self(total)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate ‖ up fused into one [2I, D] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = _fused_for(gate_up, 2)
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, rotary_dim] (float32), scaled by the RoPE type's factor.

    interleaved: the rotated pairs are (x0, x1), (x2, x3), ...; else (x_i, x_{i + d/2}).
    Either way the output is in the half-split layout [rotated firsts ‖ rotated seconds]: q and
    k share it, so their dot products are those of the checkpoint's layout.
    With x half-split as [x1 ‖ x2], the rotation is x * [cos ‖ cos] + [x2 ‖ x1] * [-sin ‖ sin]:
    the tables are stored that way, so a call is a roll and two products.
    Every layer of a step passes the same positions tensor: its cos/sin rows are gathered once.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, interleaved: bool) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        cos, sin = angles.cos() * scaling, angles.sin() * scaling
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)
        self.interleaved = interleaved
        self._positions: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, R], positions [T] -> rotated x (same dtype)."""
        fused = None if self.interleaved else _fused_for(x, 3)
        if fused is not None:  # reads the tables at `positions` itself
            return fused.rope(x, self.cos, self.sin, positions)
        float32 = x.dtype == torch.float32  # no casts to call (each a dispatch, per layer and step)
        x32 = x if float32 else x.float()
        if self.interleaved:  # pairs (x0, x1), (x2, x3), ... -> [x0, x2, ... ‖ x1, x3, ...]
            x32 = x32.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        cos, sin = self._tables(positions)
        out = torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, dims=-1), sin)
        return out if float32 else out.to(x.dtype)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows [T, 1, rotary_dim] of `positions` (reused while it is the same tensor)."""
        if positions is not self._positions or self._rows is None:
            self._positions = positions
            self._rows = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return self._rows


class DecoderStack(ModelFamily):
    """The pieces every family shares when laid out as transformers' *ForCausalLM: `model.layers[i]`
    has `self_attn.attend(step, *inputs)` and `after_attention(x, attn_out, rows)`; `model.norm`."""

    model: nn.Module

    def attend(self, i: int, step: StepContext, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.model.layers[i].self_attn.attend(step, *inputs)

    def after_attention(self, i: int, x: torch.Tensor, attn_out: torch.Tensor,
                        output_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.layers[i].after_attention(x, attn_out, output_rows)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)
