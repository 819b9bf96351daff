"""The Triton recurrences at full model sizes on a GPU (Qwen3-Next's Gated DeltaNet, Granite 4.0
hybrid's Mamba2), against the PyTorch loops run on the CPU in float32 over the same inputs: a
mixed step of decodes, first prefill chunks, continued chunks and a verify chunk (row by row),
and the same step without the verify chunk's kept states (the chunked form, whose chunk scan is
Triton's on the GPU)."""

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


@pytest.mark.parametrize("keep", [True, False], ids=["row_by_row", "chunked"])
def test_gated_delta_rule_at_qwen3_next_sizes(keep: bool) -> None:
    g = torch.Generator().manual_seed(1)
    t, hk, hv, dk, dv = sum(LENS), 16, 32, 128, 128
    inputs = (torch.randn(t, hk, dk, generator=g).bfloat16(), torch.randn(t, hk, dk, generator=g).bfloat16(),
              torch.randn(t, hv, dv, generator=g).bfloat16(), -torch.rand(t, hv, generator=g),
              torch.rand(t, hv, generator=g))
    states = torch.randn(POOL, hv, dk, dv, generator=g)
    want_states, want_rows, got_rows = states.clone(), [], []
    want = gated_delta_rule(*inputs, want_states, _meta("cpu", keep), want_rows if keep else None)
    got_states = states.cuda()
    got = gated_delta_rule(*(x.cuda() for x in inputs), got_states, _meta("cuda", keep),
                           got_rows if keep else None)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_states.cpu(), want_states, rtol=1e-4, atol=1e-4)
    if keep:
        torch.testing.assert_close(got_rows[0].cpu(), want_rows[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("keep", [True, False], ids=["row_by_row", "chunked"])
def test_mamba2_scan_at_granite_hybrid_sizes(keep: bool) -> None:
    g = torch.Generator().manual_seed(2)
    t, h, p, groups, n = sum(LENS), 128, 64, 1, 128
    x, dt = torch.randn(t, h, p, generator=g).bfloat16(), torch.randn(t, h, generator=g).bfloat16()
    b = torch.randn(t, groups, n, generator=g).bfloat16()
    c = torch.randn(t, groups, n, generator=g).bfloat16()
    a, d, bias = -torch.rand(h, generator=g) * 4, torch.randn(h, generator=g), torch.randn(h, generator=g)
    states = torch.randn(POOL, h, p, n, generator=g)
    want_states, want_rows, got_rows = states.clone(), [], []
    limit = (0.0, float("inf"))
    want = mamba2_scan(x, dt, a, b, c, d, bias, limit, want_states, _meta("cpu", keep),
                       want_rows if keep else None)
    got_states = states.cuda()
    got = mamba2_scan(*(v.cuda() for v in (x, dt, a, b, c, d, bias)), limit, got_states, _meta("cuda", keep),
                      got_rows if keep else None)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_states.cpu(), want_states, rtol=1e-4, atol=1e-4)
    if keep:
        torch.testing.assert_close(got_rows[0].cpu(), want_rows[0], rtol=1e-4, atol=1e-4)
