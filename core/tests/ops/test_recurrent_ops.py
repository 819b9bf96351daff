"""The recurrent ops against float64 step-by-step recurrences written from the papers' formulas
(Gated DeltaNet: Yang et al. 2024, eq. 10; Mamba2: Dao & Gu 2024, the SSM recurrence), one
request at a time, over batches that mix decodes, first prefill chunks, continued chunks and
verify chunks whose per-row states are kept."""

from __future__ import annotations

import math
import os

import pytest
import torch
from jackfield.ops import recurrent
from jackfield.ops.recurrent import causal_conv1d, gated_delta_rule, mamba2_scan, recurrent_metadata

SEED = 20261202
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # where the Triton kernels run (compiled on a GPU, else interpreted)
TRITON_HERE = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_HERE, reason="Triton needs CUDA or TRITON_INTERPRET=1"))]


def _delta_rule_impl(impl: str, batch: str):  # type: ignore[no-untyped-def]
    """The op under test: PyTorch; Triton's row-by-row kernel (short steps); or, for long steps,
    Triton's chunked form over the flat batch (what CUDA runs)."""
    if impl == "torch":
        return gated_delta_rule
    from jackfield.ops import recurrent_triton

    if batch == "long":
        def chunked(*args: torch.Tensor, kept: None = None) -> torch.Tensor:
            return recurrent_triton.gated_delta_rule_chunked_triton(*args, recurrent.CHUNK)

        return chunked
    return recurrent_triton.gated_delta_rule_triton


def _mamba2_impl(impl: str, batch: str, patch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    if impl == "torch":
        return mamba2_scan
    from jackfield.ops import recurrent_triton

    if batch == "long":
        patch.setattr(recurrent, "_chunk_scan", recurrent_triton.chunk_scan_triton)
        return mamba2_scan
    return recurrent_triton.mamba2_scan_triton


def _generator(offset: int) -> torch.Generator:
    print(f"seed {SEED + offset}")
    return torch.Generator().manual_seed(SEED + offset)


# (rows this step, slot holds earlier tokens, per-row states kept): a decode, a first prefill
# chunk, a continued chunk, a verify chunk of 1 + 3 rows, a first chunk shorter than the conv
# window, a verify chunk of 1 + 1 rows (its per-row states past its 2 rows: its last state)
REQUESTS = [(1, True, False), (7, False, False), (5, True, False), (4, True, True), (2, False, False),
            (2, True, True)]
SLOTS = [3, 0, 5, 1, 4, 2]
NUM_SLOTS = 6
KEPT_ROWS = 4  # the longest kept request's rows: the per-row states' length


# A step with prefill chunks longer than ops.recurrent.CHUNK (and no kept states): the chunked
# form, whose float32 rounding over 150 rows is held to 1e-4 instead of 1e-5.
LONG_REQUESTS = [(1, True, False), (150, False, False), (70, True, False), (3, True, False),
                 (64, True, False), (9, True, False)]
BATCHES = {"short": REQUESTS, "long": LONG_REQUESTS}
TOLERANCE = {"short": 1e-5, "long": 1e-4}
Requests = list[tuple[int, bool, bool]]


def _meta(kernels: set[int], requests: Requests = REQUESTS, device: str = "cpu"):  # type: ignore[no-untyped-def]
    return recurrent_metadata([r[0] for r in requests], SLOTS, [r[1] for r in requests],
                              [i for i, r in enumerate(requests) if r[2]], kernels, device)


def _rows(b: int, requests: Requests = REQUESTS) -> slice:
    start = sum(r[0] for r in requests[:b])
    return slice(start, start + requests[b][0])


def _check_kept(kept: torch.Tensor, b: int, after: list[torch.Tensor], tol: float) -> None:
    """Request b's per-row states ([V, KEPT_ROWS, ...]: b's place among the kept requests): the
    state after each of its rows, then its last state up to the longest kept request's rows."""
    assert kept.shape[:2] == (sum(r[2] for r in REQUESTS), KEPT_ROWS)
    index = sum(r[2] for r in REQUESTS[:b])
    for j in range(KEPT_ROWS):
        torch.testing.assert_close(kept[index, j].double(), after[min(j, len(after) - 1)], rtol=tol, atol=tol)


def test_causal_conv1d_matches_float64_window_recurrence() -> None:
    gen = _generator(0)
    channels, kernel = 6, 4
    meta = _meta({kernel})
    x = torch.randn(meta.num_tokens, channels, generator=gen)
    weight, bias = torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen)
    states = torch.randn(NUM_SLOTS, channels, kernel - 1, generator=gen)
    before = states.clone()
    kept: list[torch.Tensor] = []
    out = causal_conv1d(x, weight, bias, states, meta, kept)
    for b, (_, has_state, keep) in enumerate(REQUESTS):
        window = (before[SLOTS[b]].double() if has_state
                  else torch.zeros(channels, kernel - 1, dtype=torch.float64))
        windows = []
        for row in range(_rows(b).start, _rows(b).stop):
            full = torch.cat([window, x[row].double()[:, None]], dim=1)
            expect = torch.nn.functional.silu((full * weight.double()).sum(1) + bias.double())
            torch.testing.assert_close(out[row].double(), expect, rtol=1e-5, atol=1e-5)
            window = full[:, 1:]
            windows.append(window)
        if keep:
            _check_kept(kept[0], b, windows, 0.0)
        torch.testing.assert_close(states[SLOTS[b]].double(), window, rtol=0, atol=0)


def _delta_rule_reference(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """float64, one request: q, k [L, Hk, Dk], v [L, Hv, Dv] -> outputs, states after each row."""
    repeat = v.shape[1] // q.shape[1]
    outs, states = [], []
    for t in range(q.shape[0]):
        qt = q[t].repeat_interleave(repeat, 0)
        kt = k[t].repeat_interleave(repeat, 0)
        qt = qt / (qt.square().sum(-1, keepdim=True) + 1e-6).sqrt() / math.sqrt(q.shape[2])
        kt = kt / (kt.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        new = torch.empty_like(state)
        out = torch.empty(v.shape[1], v.shape[2], dtype=torch.float64)
        for h in range(v.shape[1]):
            s = math.exp(g[t, h]) * state[h]  # [Dk, Dv]
            s = s + beta[t, h] * torch.outer(kt[h], v[t, h] - s.T @ kt[h])
            new[h], out[h] = s, s.T @ qt[h]
        state = new
        outs.append(out)
        states.append(state)
    return torch.stack(outs), states


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("impl", IMPLS)
def test_gated_delta_rule_matches_float64_recurrence(impl: str, batch: str) -> None:
    gen = _generator(1)
    hk, hv, dk, dv = 2, 4, 8, 6
    requests, tol = BATCHES[batch], TOLERANCE[batch]
    device = DEVICE if impl == "triton" else "cpu"
    meta = _meta(set(), requests, device)
    t = meta.num_tokens
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 2
    beta = torch.rand(t, hv, generator=gen)
    before = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)
    states = before.to(device, copy=True)
    kept: list[torch.Tensor] = []
    op = _delta_rule_impl(impl, batch)
    kept_or_none = kept if batch == "short" else None
    out = op(*(x.to(device) for x in (q, k, v, g, beta)), states, meta, kept=kept_or_none)
    out, states, kept = out.cpu(), states.cpu(), [rows.cpu() for rows in kept]
    for b, (_, has_state, keep) in enumerate(requests):
        rows = _rows(b, requests)
        start = before[SLOTS[b]].double() if has_state else torch.zeros(hv, dk, dv, dtype=torch.float64)
        expect, after = _delta_rule_reference(q[rows].double(), k[rows].double(), v[rows].double(),
                                              g[rows].double(), beta[rows].double(), start)
        torch.testing.assert_close(out[rows].double(), expect, rtol=tol, atol=tol)
        torch.testing.assert_close(states[SLOTS[b]].double(), after[-1], rtol=tol, atol=tol)
        if keep:
            _check_kept(kept[0], b, after, tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_gated_delta_rule_with_weak_decay_and_similar_keys(impl: str) -> None:
    """The chunked form where rows far apart within a chunk still interact: log decays near 0
    and keys close to one another (|A[i, j]| up to ~1 across the whole chunk, so every term of
    the chunk's triangular solve matters, not only those near the diagonal)."""
    gen = _generator(4)
    hk, hv, dk, dv = 1, 2, 16, 16
    requests, slots = [(150, True, False), (64, False, False), (80, True, False)], [4, 0, 2]
    device = DEVICE if impl == "triton" else "cpu"
    meta = recurrent_metadata([r[0] for r in requests], slots, [r[1] for r in requests], [], set(), device)
    t = meta.num_tokens
    k = torch.randn(1, hk, dk, generator=gen) + 0.3 * torch.randn(t, hk, dk, generator=gen)
    q, v = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hv, dv, generator=gen)
    g = -0.02 * torch.rand(t, hv, generator=gen)
    beta = 0.5 + 0.5 * torch.rand(t, hv, generator=gen)
    before = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)
    states = before.to(device, copy=True)
    out = _delta_rule_impl(impl, "long")(*(x.to(device) for x in (q, k, v, g, beta)), states, meta).cpu()
    for b, (_, has_state, _) in enumerate(requests):
        rows = _rows(b, requests)
        start = before[slots[b]].double() if has_state else torch.zeros(hv, dk, dv, dtype=torch.float64)
        expect, after = _delta_rule_reference(q[rows].double(), k[rows].double(), v[rows].double(),
                                              g[rows].double(), beta[rows].double(), start)
        torch.testing.assert_close(out[rows].double(), expect, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states.cpu()[slots[b]].double(), after[-1], rtol=1e-4, atol=1e-4)


def _mamba2_reference(x, dt, a, b, c, d, dt_bias, state):  # type: ignore[no-untyped-def]
    """float64, one request: x [L, H, P], b, c [L, G, N] -> outputs, states after each row."""
    repeat = x.shape[1] // b.shape[1]
    outs, states = [], []
    for t in range(x.shape[0]):
        new = torch.empty_like(state)
        out = torch.empty_like(x[t])
        for h in range(x.shape[1]):
            step = math.log1p(math.exp(dt[t, h] + dt_bias[h]))
            s = math.exp(step * a[h]) * state[h] + step * torch.outer(x[t, h], b[t, h // repeat])
            new[h], out[h] = s, s @ c[t, h // repeat] + d[h] * x[t, h]
        state = new
        outs.append(out)
        states.append(state)
    return torch.stack(outs), states


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("impl", IMPLS)
def test_mamba2_scan_matches_float64_recurrence(impl: str, batch: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _generator(2)
    heads, p, groups, n = 4, 3, 2, 5
    requests, tol = BATCHES[batch], TOLERANCE[batch]
    device = DEVICE if impl == "triton" else "cpu"
    meta = _meta(set(), requests, device)
    t = meta.num_tokens
    x, dt = torch.randn(t, heads, p, generator=gen), torch.randn(t, heads, generator=gen)
    b, c = torch.randn(t, groups, n, generator=gen), torch.randn(t, groups, n, generator=gen)
    a = -torch.rand(heads, generator=gen) * 4
    d, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    before = torch.randn(NUM_SLOTS, heads, p, n, generator=gen)
    states = before.to(device, copy=True)
    kept: list[torch.Tensor] = []
    inputs = (y.to(device) for y in (x, dt, a, b, c, d, dt_bias))
    out = _mamba2_impl(impl, batch, monkeypatch)(*inputs, (0.0, math.inf), states, meta,
                                                 kept if batch == "short" else None)
    out, states, kept = out.cpu(), states.cpu(), [rows.cpu() for rows in kept]
    for r, (_, has_state, keep) in enumerate(requests):
        rows = _rows(r, requests)
        start = before[SLOTS[r]].double() if has_state else torch.zeros(heads, p, n, dtype=torch.float64)
        expect, after = _mamba2_reference(x[rows].double(), dt[rows].double(), a.double(), b[rows].double(),
                                          c[rows].double(), d.double(), dt_bias.double(), start)
        torch.testing.assert_close(out[rows].double(), expect, rtol=tol, atol=tol)
        torch.testing.assert_close(states[SLOTS[r]].double(), after[-1], rtol=tol, atol=tol)
        if keep:
            _check_kept(kept[0], r, after, tol)


def test_chunks_over_several_steps_equal_one_pass() -> None:
    """A 23-token sequence run as chunks of 7, 1, 9, 6 beside other requests' rows gives the
    one-pass outputs and state: chunked prefill carries the conv window and the state."""
    gen = _generator(3)
    hk, hv, dk, dv, kernel = 1, 2, 4, 3, 4
    total = 23
    q, k = torch.randn(total, hk, dk, generator=gen), torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g, beta = -torch.rand(total, hv, generator=gen), torch.rand(total, hv, generator=gen)
    conv_x, weight = torch.randn(total, 5, generator=gen), torch.randn(5, kernel, generator=gen)

    def run(chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        states, conv_states = torch.zeros(2, hv, dk, dv), torch.zeros(2, 5, kernel - 1)
        outs, convs, start = [], [], 0
        for i, n in enumerate(chunks):
            # another request (slot 1, 3 rows) shares each step, first in the batch
            meta = recurrent_metadata([3, n], [1, 0], [False, i > 0], [], {kernel}, "cpu")
            other = torch.randn(3, hv, dv, generator=gen)
            rows = slice(start, start + n)

            def cat(mine: torch.Tensor) -> torch.Tensor:
                return torch.cat([torch.randn(3, *mine.shape[1:], generator=gen), mine])

            out = gated_delta_rule(cat(q[rows]), cat(k[rows]), torch.cat([other, v[rows]]),
                                   cat(g[rows]).clamp(max=0), cat(beta[rows]).abs(), states, meta)
            outs.append(out[3:])
            convs.append(causal_conv1d(cat(conv_x[rows]), weight, None, conv_states, meta)[3:])
            start += n
        return torch.cat(outs), torch.cat(convs), states[0]

    whole = run([total])
    chunked = run([7, 1, 9, 6])
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused() -> None:
    meta = _meta({4})
    t = meta.num_tokens
    bf16_states = torch.zeros(NUM_SLOTS, 1, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule(torch.randn(t, 1, 4), torch.randn(t, 1, 4), torch.randn(t, 1, 4),
                         -torch.rand(t, 1), torch.rand(t, 1), bf16_states, meta)
    with pytest.raises(ValueError, match="outside the pool"):
        causal_conv1d(torch.randn(t, 3), torch.randn(3, 4), None, torch.zeros(2, 3, 3), meta)
    with pytest.raises(ValueError, match="rows"):
        causal_conv1d(torch.randn(t + 1, 3), torch.randn(3, 4), None, torch.zeros(9, 3, 3), meta)


@pytest.mark.slow
@pytest.mark.parametrize(("k", "v", "corrections", "stages"), [(128, 128, True, 2), (128, 64, False, 3)],
                         ids=["qwen3_next_gdn", "granite_hybrid_mamba2"])
def test_chunk_scan_stages_fit_hopper_shared_memory(k: int, v: int, corrections: bool, stages: int) -> None:
    """The chunk scan at Qwen3-Next's GDN sizes (Dk = Dv = 128, with corrections) and Granite 4.0
    hybrid's Mamba2 sizes (N = 128, P = 64) on an H100/H200 (227 KiB of shared memory a
    program): the most pipeline stages that fit are chosen, and Triton's own count of the
    kernel's shared memory, compiled here for sm_90 without a GPU, is within the bound the
    stages are chosen by."""
    from jackfield.ops.recurrent_triton import (
        VALUE_BLOCK,
        _chunk_scan_kernel,
        chunk_scan_shared_bytes,
        chunk_scan_stages,
    )
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    hopper = 227 * 1024
    assert chunk_scan_stages(k, VALUE_BLOCK, recurrent.CHUNK, corrections, hopper) == stages
    pointers = ("q_ptr", "attend_ptr", "values_ptr", "corr_ptr", "keys_ptr", "decay_ptr", "out_ptr",
                "state_ptr")
    constants = dict(K=k, V=v, C=recurrent.CHUNK, BK=k, BV=VALUE_BLOCK, HAS_CORRECTIONS=corrections)
    signature = {**dict.fromkeys(pointers, "*fp32"), "num_chunks": "i32",
                 **dict.fromkeys(constants, "constexpr")}
    kernel = JITFunction(_chunk_scan_kernel.fn)  # compilable also where TRITON_INTERPRET=1 wraps it
    source = ASTSource(kernel, signature, constexprs=constants)
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_stages": stages})
    bound = chunk_scan_shared_bytes(k, VALUE_BLOCK, recurrent.CHUNK, corrections, stages)
    print(f"shared memory: Triton {compiled.metadata.shared} bytes, bound {bound}, limit {hopper}")
    assert compiled.metadata.shared <= bound <= hopper
