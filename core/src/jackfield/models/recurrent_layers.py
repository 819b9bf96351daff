"""The recurrent token mixers of hybrid models: Gated DeltaNet (Qwen3-Next's linear attention)
and Mamba2 (Granite 4.0 hybrid). Each is split as the model contract's pieces: `project` (the
input projections, before the step's state is touched), `mix` (conv1d + recurrence over the
step's state slots, the only part that reads the step) and `output` (the output projection).
Parameter names follow the checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jackfield.contracts.recurrent import RecurrentStateSpec, RecurrentStep
from jackfield.models.layers import Linear, select_rows
from jackfield.ops.recurrent import causal_conv1d, gated_delta_rule, mamba2_scan


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _row_lists(step: RecurrentStep) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Lists the ops append per-row states to when the step keeps some (verify chunks)."""
    if step.metadata.keep_requests.numel() == 0:
        return None, None
    return [], []


def _keep(step: RecurrentStep, index: int, conv: list[torch.Tensor] | None,
          state: list[torch.Tensor] | None) -> None:
    if conv is not None and state is not None:
        step.rows.conv[index], step.rows.state[index] = conv[0], state[0]


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention. in_proj_qkvz holds, per key head, [q ‖ k ‖ v ‖ z] (v and z
    for the Hv/Hk value heads it serves); in_proj_ba per key head [b ‖ a]."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.eps = eps
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, dtype)
        self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = _empty(self.conv_dim, 1, conv_kernel, dtype=dtype)
        self.dt_bias = _empty(num_v_heads, dtype=dtype)
        self.A_log = _empty(num_v_heads, dtype=dtype)
        self.norm = nn.Module()
        self.norm.weight = _empty(head_v_dim, dtype=dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, dtype)

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec("gated_delta_net", self.conv_dim, self.conv1d.weight.shape[-1],
                                  (self.hv, self.dk, self.dv), self.conv1d.weight.dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> (q ‖ k ‖ v [T, conv_dim], z [T, Hv, Dv], b, a [T, Hv])."""
        t, per = x.shape[0], self.hv // self.hk
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.hk, -1).split(
            [self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def mix(self, step: RecurrentStep, index: int, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
            a: torch.Tensor) -> torch.Tensor:
        """Recurrent layer `index`'s conv1d and gated delta rule over the step's states, then the
        gated RMSNorm: [T, Hv * Dv] in the activation dtype."""
        t = mixed.shape[0]
        conv_rows, state_rows = _row_lists(step)
        mixed = causal_conv1d(mixed, self.conv1d.weight.squeeze(1), None, step.conv_states[index],
                              step.metadata, conv_rows)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = gated_delta_rule(q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk),
                               v.view(t, self.hv, self.dv), g, b.sigmoid(), step.states[index], step.metadata,
                               state_rows)
        _keep(step, index, conv_rows, state_rows)
        # The gated RMSNorm: weight * normalize(o) (in the activation dtype), times silu(z), in float32.
        normed = self.norm.weight * F.rms_norm(out.to(z.dtype).float(), (self.dv,), eps=self.eps).to(z.dtype)
        return (normed.float() * F.silu(z.float())).to(z.dtype).reshape(t, self.value_dim)

    def output(self, mixed: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return self.out_proj(select_rows(mixed, rows))


class Mamba2Mixer(nn.Module):
    """Mamba2 with grouped B and C, the D skip, dt bias + softplus, and the RMSNorm gated by z
    (per group of the inner size). in_proj gives [z ‖ x ‖ B ‖ C ‖ dt]; x, B and C go through the
    conv1d."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_groups: int, state_size: int,
                 conv_kernel: int, conv_bias: bool, dt_limit: tuple[float, float], eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.p, self.groups, self.n = num_heads, head_dim, num_groups, state_size
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * num_groups * state_size
        self.dt_limit, self.eps = dt_limit, eps
        self.in_proj = Linear(hidden_size, self.inner + self.conv_dim + num_heads, dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = _empty(self.conv_dim, 1, conv_kernel, dtype=dtype)
        self.conv1d.bias = _empty(self.conv_dim, dtype=dtype) if conv_bias else None
        self.dt_bias = _empty(num_heads, dtype=dtype)
        self.A_log = _empty(num_heads, dtype=dtype)
        self.D = _empty(num_heads, dtype=dtype)
        self.norm = nn.Module()
        self.norm.weight = _empty(self.inner, dtype=dtype)
        self.out_proj = Linear(self.inner, hidden_size, dtype)

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec("mamba2", self.conv_dim, self.conv1d.weight.shape[-1],
                                  (self.heads, self.p, self.n), self.conv1d.weight.dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> (z [T, inner], x ‖ B ‖ C [T, conv_dim], dt [T, H])."""
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        return z, xbc, dt

    def mix(self, step: RecurrentStep, index: int, z: torch.Tensor, xbc: torch.Tensor,
            dt: torch.Tensor) -> torch.Tensor:
        """Recurrent layer `index`'s conv1d and scan over the step's states, then the gated
        RMSNorm: [T, inner] in the activation dtype."""
        t = xbc.shape[0]
        conv_rows, state_rows = _row_lists(step)
        xbc = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, step.conv_states[index],
                            step.metadata, conv_rows)
        x, b, c = xbc.split([self.inner, self.groups * self.n, self.groups * self.n], dim=-1)
        y = mamba2_scan(x.view(t, self.heads, self.p), dt, -self.A_log.float().exp(),
                        b.view(t, self.groups, self.n), c.view(t, self.groups, self.n), self.D, self.dt_bias,
                        self.dt_limit, step.states[index], step.metadata, state_rows)
        _keep(step, index, conv_rows, state_rows)
        # gate first, then RMSNorm per group (in float32), the weight applied in the activation dtype
        gated = y.reshape(t, self.inner) * F.silu(z.float())
        normed = F.rms_norm(gated.view(t, self.groups, -1), (self.inner // self.groups,), eps=self.eps)
        return self.norm.weight * normed.view(t, self.inner).to(z.dtype)

    def output(self, mixed: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return self.out_proj(select_rows(mixed, rows))
