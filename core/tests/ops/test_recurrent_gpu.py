"""The Triton recurrences at full model sizes on a GPU (Qwen3-Next's Gated DeltaNet, Granite 4.0
hybrid's Mamba2): a mixed step of decodes, first prefill chunks, continued chunks and a verify
chunk (row by row, its per-row states kept), and the same step without the kept states (the
chunked form, whose chunk scan is Triton's on the GPU).

Outputs, final states and per-row states are compared with float64 recurrences written from the
papers' formulas (Gated DeltaNet: Yang et al. 2024, eq. 10; Mamba2: Dao & Gu 2024). The bound is
the float32 noise measured in the same test: the PyTorch op run in float32 on the CPU is off the
float64 recurrence by `noise` (as max |diff| / (1 + |want|)); the GPU may be off by 4x that, and
never needs to be closer than 1e-4 (the CPU op tests' tolerance at these lengths). Mamba2's outputs
reach a few hundred at these sizes: the CPU's own float32 error there is ~1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch
from jackfield.ops.recurrent import gated_delta_rule, mamba2_scan, recurrent_metadata

pytestmark = pytest.mark.gpu

LENS = [1, 1, 1, 4, 70, 33, 129]  # decodes, a verify chunk of 1 + 3, prefill chunks
HAS_STATE = [True, True, True, True, False, True, False]
KEEP = [3]
POOL = 16


def _meta(device: str, keep: bool):  # type: ignore[no-untyped-def]
    slots = torch.randperm(POOL, generator=torch.Generator().manual_seed(0))[: len(LENS)].tolist()
    return recurrent_metadata(LENS, slots, HAS_STATE, KEEP if keep else [], frozenset(), device)


def _requests(meta) -> list[tuple[int, slice, bool]]:  # type: ignore[no-untyped-def]
    """(slot, flat rows, slot holds a state) per request."""
    starts, slots = meta.query_start_loc.tolist(), meta.state_slots.tolist()
    return [(slot, slice(starts[b], starts[b + 1]), HAS_STATE[b]) for b, slot in enumerate(slots)]


def _float64_run(step, inputs: tuple[torch.Tensor, ...], states: torch.Tensor, meta, keep: bool):  # type: ignore[no-untyped-def]
    """`step(row inputs, state) -> (output, state)` over each request's rows in float64: the
    outputs [T, ...], the final states (the pool after the step) and the kept request's states
    after each of its rows."""
    out, pool, kept = [], states.double().clone(), []
    for b, (slot, rows, has_state) in enumerate(_requests(meta)):
        state = pool[slot] if has_state else torch.zeros_like(pool[slot])
        for t in range(rows.start, rows.stop):
            y, state = step(tuple(x[t].double() for x in inputs), state)
            out.append(y)
            if keep and b in KEEP:
                kept.append(state)
        pool[slot] = state
    return torch.stack(out), pool, (torch.stack(kept)[None] if keep else None)


def _delta_rule_step(row: tuple[torch.Tensor, ...], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of the gated delta rule, every value head at once: state [Hv, Dk, Dv]."""
    q, k, v, g, beta = row
    repeat = v.shape[0] // q.shape[0]
    scale = q.shape[-1] ** -0.5
    q = (q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(repeat, 0) * scale
    k = (k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(repeat, 0)
    state = g.exp()[:, None, None] * state
    delta = beta[:, None] * (v - torch.einsum("hk,hkv->hv", k, state))
    state = state + k[:, :, None] * delta[:, None, :]
    return torch.einsum("hk,hkv->hv", q, state), state


def _assert_within_noise(name: str, got: torch.Tensor, cpu: torch.Tensor, want: torch.Tensor) -> None:
    """got (GPU) and cpu (the PyTorch op in float32) against want (float64): got within 4x the
    CPU's float32 noise, or 1e-4."""
    def off(x: torch.Tensor) -> float:
        return float(((x.double() - want).abs() / (1 + want.abs())).max())

    noise = off(cpu)
    tol = max(1e-4, 4 * noise)
    print(f"{name}: |want| up to {float(want.abs().max()):.3g}; off float64 (relative to 1 + |want|): "
          f"CPU float32 {noise:.2e}, GPU {off(got):.2e}, allowed {tol:.2e}")
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("keep", [True, False], ids=["row_by_row", "chunked"])
def test_gated_delta_rule_at_qwen3_next_sizes(keep: bool) -> None:
    g = torch.Generator().manual_seed(1)
    t, hk, hv, dk, dv = sum(LENS), 16, 32, 128, 128
    inputs = (torch.randn(t, hk, dk, generator=g).bfloat16(), torch.randn(t, hk, dk, generator=g).bfloat16(),
              torch.randn(t, hv, dv, generator=g).bfloat16(), -torch.rand(t, hv, generator=g),
              torch.rand(t, hv, generator=g))
    states = torch.randn(POOL, hv, dk, dv, generator=g)
    cpu_states, cpu_rows, got_rows = states.clone(), [], []
    cpu = gated_delta_rule(*inputs, cpu_states, _meta("cpu", keep), cpu_rows if keep else None)
    got_states = states.cuda()
    got = gated_delta_rule(*(x.cuda() for x in inputs), got_states, _meta("cuda", keep),
                           got_rows if keep else None)
    want, want_states, want_rows = _float64_run(_delta_rule_step, inputs, states, _meta("cpu", keep), keep)
    _assert_within_noise("outputs", got.cpu(), cpu, want)
    _assert_within_noise("states", got_states.cpu(), cpu_states, want_states)
    if keep:
        _assert_within_noise("per-row states", got_rows[0].cpu(), cpu_rows[0], want_rows)


def _mamba2_step(a: torch.Tensor, d: torch.Tensor, bias: torch.Tensor):  # type: ignore[no-untyped-def]
    """One row of Mamba2's scan, every head at once (dt unclamped: the test's limit is (0, inf))."""
    def step(row: tuple[torch.Tensor, ...], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, dt, b, c = row
        repeat = x.shape[0] // b.shape[0]
        b, c = b.repeat_interleave(repeat, 0), c.repeat_interleave(repeat, 0)
        dt = torch.log1p((dt + bias.double()).exp())
        state = (dt * a.double()).exp()[:, None, None] * state + (dt[:, None] * x)[:, :, None] * b[:, None, :]
        return torch.einsum("hpn,hn->hp", state, c) + d.double()[:, None] * x, state

    return step


@pytest.mark.parametrize("keep", [True, False], ids=["row_by_row", "chunked"])
def test_mamba2_scan_at_granite_hybrid_sizes(keep: bool) -> None:
    g = torch.Generator().manual_seed(2)
    t, h, p, groups, n = sum(LENS), 128, 64, 1, 128
    x, dt = torch.randn(t, h, p, generator=g).bfloat16(), torch.randn(t, h, generator=g).bfloat16()
    b = torch.randn(t, groups, n, generator=g).bfloat16()
    c = torch.randn(t, groups, n, generator=g).bfloat16()
    a, d, bias = -torch.rand(h, generator=g) * 4, torch.randn(h, generator=g), torch.randn(h, generator=g)
    states = torch.randn(POOL, h, p, n, generator=g)
    cpu_states, cpu_rows, got_rows = states.clone(), [], []
    limit = (0.0, float("inf"))
    cpu = mamba2_scan(x, dt, a, b, c, d, bias, limit, cpu_states, _meta("cpu", keep),
                      cpu_rows if keep else None)
    got_states = states.cuda()
    got = mamba2_scan(*(v.cuda() for v in (x, dt, a, b, c, d, bias)), limit, got_states, _meta("cuda", keep),
                      got_rows if keep else None)
    want, want_states, want_rows = _float64_run(_mamba2_step(a, d, bias), (x, dt, b, c), states,
                                                _meta("cpu", keep), keep)
    _assert_within_noise("outputs", got.cpu(), cpu, want)
    _assert_within_noise("states", got_states.cpu(), cpu_states, want_states)
    if keep:
        _assert_within_noise("per-row states", got_rows[0].cpu(), cpu_rows[0], want_rows)
