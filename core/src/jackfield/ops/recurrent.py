"""Recurrent-layer ops over a step's flat batch (PyTorch; the CPU path and the GPU kernels' oracle).

Each op reads and writes the per-request states in a slot pool (contracts/recurrent.py): a
request starts from its slot's state when `has_state` says the slot holds its earlier tokens,
from zero otherwise, and leaves its state after its last row in the slot. The batch is gathered
into [B, max_query_len] by `padded_rows` (a zero row past each request's rows) and the
recurrences step over the columns for every request at once: a padding column has decay 1 and
no update, so it leaves a request's state as it was. Prefill chunks and decodes mix freely; a
chunk that continues a request's prompt starts from the state its last step left.

Kept requests (speculative verify chunks) also get their states after each row
(`RowStates`), so the state can be rolled back to the last accepted row after sampling: rows
0 .. kept_rows - 1 (the longest kept request's), past a request's own rows the state its last
row left.

A step with a request of more than CHUNK rows (and no kept states) runs the recurrences in the
chunked matmul form instead of row by row: what is parallel over chunks in batched PyTorch, the
scan from chunk to chunk in one loop (`_chunk_scan`). On CUDA the row-by-row recurrences of
shorter steps are Triton kernels (ops/recurrent_triton.py, held to these loops by the tests), so
are the gated delta rule's whole chunked form (two kernels over the flat batch, no padding) and
Mamba2's chunk scan; the conv1d stays one batched PyTorch conv.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from jackfield.contracts.recurrent import RecurrentMetadata

# Rows per chunk of the chunked (matmul) form, which a step runs when one of its requests has
# more rows than that and no per-row states are kept; shorter steps (decodes) step row by row.
CHUNK = 64


def recurrent_metadata(query_lens: list[int], state_slots: list[int], has_state: list[bool],
                       keep_requests: list[int], conv_kernels: set[int] | frozenset[int],
                       device: torch.device | str) -> RecurrentMetadata:
    """A step's RecurrentMetadata from host lists: per request (decodes first) its rows this
    step, its state slot, whether the slot holds its earlier tokens; the requests whose per-row
    states are kept; the conv kernel sizes of the model's recurrent layers."""
    if not len(query_lens) == len(state_slots) == len(has_state) or not query_lens or min(query_lens) < 1:
        raise ValueError(f"recurrent metadata: {len(query_lens)} query lengths (each >= 1), "
                         f"{len(state_slots)} slots, {len(has_state)} state flags")
    lens = torch.tensor(query_lens, dtype=torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    tokens, width = int(starts[-1]), int(lens.max())
    columns = torch.arange(width)
    valid = columns < lens[:, None]
    padded = torch.where(valid, starts[:-1, None] + columns, tokens)
    windows = {k: lens[:, None] + torch.arange(k - 1) for k in sorted(conv_kernels)}
    kept_rows = max((query_lens[i] for i in keep_requests), default=0)
    return RecurrentMetadata(
        query_start_loc=starts.to(device), query_lens=lens.to(device),
        state_slots=torch.tensor(state_slots, dtype=torch.int64).to(device),
        has_state=torch.tensor(has_state, dtype=torch.bool).to(device),
        padded_rows=padded.to(device), valid_rows=valid.flatten().nonzero().squeeze(1).to(device),
        conv_windows={k: w.to(device) for k, w in windows.items()},
        keep_requests=torch.tensor(keep_requests, dtype=torch.int64).to(device),
        num_tokens=tokens, max_query_len=width, kept_rows=kept_rows)


def _check(name: str, tensor: torch.Tensor, rows: int, dims: int) -> None:
    if tensor.dim() != dims or tensor.shape[0] != rows:
        raise ValueError(f"{name}: expected {dims} dims and {rows} rows, got shape {tuple(tensor.shape)}")


def _check_slots(states: torch.Tensor, meta: RecurrentMetadata) -> None:
    """Slots inside the pool. On a GPU this would sync the host (and break a CUDA graph's
    capture): there the engine checks the slots on the host when it builds the metadata."""
    if states.is_cuda:
        return
    if meta.num_reqs and int(meta.state_slots.max()) >= states.shape[0]:
        raise ValueError(f"state slot {int(meta.state_slots.max())} is outside the pool of "
                         f"{states.shape[0]} slots")


def _padded(x: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
    """[T, ...] -> [B, L, ...]: each request's rows, zeros past them."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[meta.padded_rows]


def _flat(padded: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
    """[B, L, ...] -> the flat batch's rows [T, ...] (the inverse of _padded)."""
    return padded.flatten(0, 1)[meta.valid_rows]


def _initial(states: torch.Tensor, meta: RecurrentMetadata, dtype: torch.dtype) -> torch.Tensor:
    """Each request's starting state: its slot's, or zero for a request computed from its start."""
    start = states[meta.state_slots].to(dtype)
    keep = meta.has_state.view(-1, *([1] * (start.dim() - 1)))
    return torch.where(keep, start, torch.zeros((), dtype=dtype, device=start.device))


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                  meta: RecurrentMetadata, kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU: x [T, C], weight [C, K] -> [T, C] in x's dtype, computed in
    the weight's dtype over [the request's window ‖ its rows]; conv_states [slots, C, K - 1] get
    the inputs of each request's last K - 1 positions. `kept`: appends [V, kept_rows, C, K - 1],
    the window after each row of the kept requests (when some are kept)."""
    _check("x", x, meta.num_tokens, 2)
    channels, kernel = weight.shape
    if x.shape[1] != channels or conv_states.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"states {tuple(conv_states.shape)} disagree")
    _check_slots(conv_states, meta)
    seq = torch.cat([_initial(conv_states, meta, weight.dtype),
                     _padded(x, meta).to(weight.dtype).transpose(1, 2)], dim=2)  # [B, C, K - 1 + L]
    out = F.silu(F.conv1d(seq, weight.unsqueeze(1), bias, groups=channels))  # [B, C, L]
    window = seq.gather(2, meta.conv_windows[kernel].unsqueeze(1).expand(-1, channels, -1))
    conv_states[meta.state_slots] = window.to(conv_states.dtype)
    if kept is not None and meta.kept_rows:
        kept.append(_kept_windows(seq[meta.keep_requests], meta).to(conv_states.dtype))
    return _flat(out.transpose(1, 2), meta).to(x.dtype)


def _kept_windows(seq: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
    """The kept requests' windows after each row, [V, kept_rows, C, K - 1], from their sequences
    [V, C, K - 1 + L]: after row j, seq[..., j + 1 : j + K]; past a request's last row, the window
    that row left (padding columns would shift zeros in)."""
    width = seq.shape[2] - meta.max_query_len
    last = meta.query_lens[meta.keep_requests] - 1
    rows = torch.minimum(torch.arange(meta.kept_rows, device=seq.device)[None, :], last[:, None])
    at = (rows[:, :, None] + 1 + torch.arange(width, device=seq.device)).flatten(1)  # [V, kept_rows (K - 1)]
    windows = seq.gather(2, at[:, None, :].expand(-1, seq.shape[1], -1))
    return windows.unflatten(2, (meta.kept_rows, width)).transpose(1, 2)


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + 1e-6) in float32, as flash-linear-attention's kernels (and transformers)."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, meta: RecurrentMetadata,
                     kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The gated delta rule (Qwen3-Next's linear attention), in float32: per value head h,

        S = exp(g) S;  S = S + beta k (v - S^T k)^T;  o = S^T (q / sqrt(Dk))

    with q and k L2-normalized (x / sqrt(|x|^2 + 1e-6)). q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv a
    multiple of Hk: key head i serves value heads i * Hv/Hk ...); g (log decay, <= 0) and beta
    [T, Hv]; states
    [slots, Hv, Dk, Dv] float32. Returns o [T, Hv, Dv] float32. `kept`: appends the state after
    each row of the kept requests, [V, kept_rows, Hv, Dk, Dv] (when some are kept)."""
    tokens = meta.num_tokens
    for name, tensor, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        _check(name, tensor, tokens, dims)
    heads, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    if (k.shape != q.shape or heads % q.shape[1] or states.shape[1:] != (heads, dk, dv)
            or g.shape[1] != heads or beta.shape[1] != heads):
        raise ValueError(f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)}, states {tuple(states.shape)} disagree")
    if states.dtype != torch.float32:
        raise ValueError(f"gated delta rule states must be float32, got {states.dtype}")
    _check_slots(states, meta)
    chunked = kept is None and meta.max_query_len > CHUNK
    if q.is_cuda:  # Triton only where it runs
        from jackfield.ops.recurrent_triton import gated_delta_rule_chunked_triton, gated_delta_rule_triton

        if chunked:
            return gated_delta_rule_chunked_triton(q, k, v, g, beta, states, meta, CHUNK)
        return gated_delta_rule_triton(q, k, v, g, beta, states, meta, kept)
    repeat = heads // q.shape[1]
    q = _l2_normalize(q).repeat_interleave(repeat, dim=1) * dk**-0.5
    k = _l2_normalize(k).repeat_interleave(repeat, dim=1)
    qp, kp, vp = _padded(q, meta), _padded(k, meta), _padded(v.float(), meta)
    gp, bp = _padded(g.float(), meta), _padded(beta.float(), meta)  # padding: decay 1, beta 0
    state = _initial(states, meta, torch.float32)  # [B, H, Dk, Dv]
    if chunked:
        out, state = _delta_rule_chunked(qp, kp, vp, gp, bp, state)
    else:
        out = torch.empty_like(vp)
        rows = []
        decay = gp.exp()
        for j in range(meta.max_query_len):
            state = state * decay[:, j, :, None, None]
            predicted = torch.einsum("bhk,bhkv->bhv", kp[:, j], state)
            delta = (vp[:, j] - predicted) * bp[:, j, :, None]
            state = state + kp[:, j, :, :, None] * delta[:, :, None, :]
            out[:, j] = torch.einsum("bhk,bhkv->bhv", qp[:, j], state)
            if kept is not None and j < meta.kept_rows:
                rows.append(state[meta.keep_requests])
        if kept is not None and rows:
            kept.append(torch.stack(rows, dim=1))
    states[meta.state_slots] = state
    return _flat(out, meta)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """[B, L, H, ...] -> [B, H, L / CHUNK, CHUNK, ...], zero-padded to whole chunks."""
    pad = -x.shape[1] % CHUNK
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    x = x.unflatten(1, (-1, CHUNK))  # [B, n, C, H, ...]
    return x.movedim(3, 1)


def _decays(log_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk, from log decays [B, H, n, C]: (exp(G_i) [.., C], exp(G_C - G_j) [.., C],
    exp(G_i - G_j) for j <= i else 0 [.., C, C]) with G the cumulative sum within the chunk."""
    cum = log_decay.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=cum.device).tril()
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -math.inf).exp()
    return cum.exp(), (cum[..., -1:] - cum).exp(), pairwise


def _delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over chunks of CHUNK rows (padded inputs [B, L, H, ...], state
    [B, H, Dk, Dv]): within a chunk from state S0, the corrections U (the delta rule's updates)
    solve (I + A) U = beta V - (beta exp(G) K) S0 with A[i, j] = beta_i exp(G_i - G_j) k_i.k_j
    (j < i), then O = (exp(G) Q) S0 + (exp(G_i - G_j) q_i.k_j)_{j <= i} U and
    S = exp(G_C) S0 + (exp(G_C - G) K)^T U. Zero rows (beta 0, log decay 0) change nothing."""
    qc, kc, vc, gc, bc = (_chunks(x) for x in (q, k, v, g, beta))  # [B, H, n, C, ...]
    start, to_end, pairwise = _decays(gc)
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril(-1)
    a = (bc[..., :, None] * pairwise * (kc @ kc.transpose(-1, -2))).masked_fill(~strict, 0.0)
    eye = torch.eye(CHUNK, device=q.device)
    solve = torch.linalg.solve_triangular(eye + a, torch.cat([bc[..., None] * vc,
                                                              (bc * start)[..., None] * kc], dim=-1),
                                          upper=False, unitriangular=True)
    u_values, u_state = solve.split([vc.shape[-1], kc.shape[-1]], dim=-1)  # U = u_values - u_state S0
    attend = pairwise * (qc @ kc.transpose(-1, -2))
    out, state = _chunk_scan(start[..., None] * qc, attend, u_values, u_state, to_end[..., None] * kc,
                             start[..., -1], state)
    return out.flatten(2, 3).movedim(1, 2)[:, : q.shape[1]], state


def _chunk_scan(queries: torch.Tensor, attend: torch.Tensor, values: torch.Tensor,
                corrections: torch.Tensor | None, keys_to_end: torch.Tensor, last_decay: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part of both chunked forms, chunk after chunk from state S [B, H, K, V]:

        U = values - corrections S;  O = queries S + attend U;  S = last_decay S + keys_to_end^T U

    (queries, corrections, keys_to_end [B, H, n, C, K]; attend [.., C, C]; values [.., C, V];
    last_decay [B, H, n]; no corrections: U = values). On CUDA one Triton launch runs the loop."""
    if state.is_cuda:
        from jackfield.ops.recurrent_triton import chunk_scan_triton

        return chunk_scan_triton(queries, attend, values, corrections, keys_to_end, last_decay, state)
    out = torch.empty_like(values)
    for n in range(values.shape[2]):
        u = values[:, :, n] if corrections is None else values[:, :, n] - corrections[:, :, n] @ state
        out[:, :, n] = queries[:, :, n] @ state + attend[:, :, n] @ u
        state = last_decay[:, :, n, None, None] * state + keys_to_end[:, :, n].transpose(-1, -2) @ u
    return out, state


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], states: torch.Tensor,
                meta: RecurrentMetadata, kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Mamba2's selective state space scan, in float32: per head h with step dt = clamp(softplus(
    dt + dt_bias)),

        S = exp(dt A) S + dt x B^T;  y = S C + D x

    x [T, H, P]; dt [T, H]; a (A, negative), d, dt_bias [H]; b, c [T, G, N] (group i serves
    heads i * H/G ...); states [slots, H, P, N] float32. Returns y [T, H, P] float32. `kept`:
    appends the state after each row of the kept requests, [V, kept_rows, H, P, N] (when some
    are kept)."""
    tokens = meta.num_tokens
    for name, tensor, dims in (("x", x, 3), ("dt", dt, 2), ("B", b, 3), ("C", c, 3)):
        _check(name, tensor, tokens, dims)
    heads, p, n = x.shape[1], x.shape[2], b.shape[2]
    if (c.shape != b.shape or heads % b.shape[1] or states.shape[1:] != (heads, p, n)
            or dt.shape[1] != heads or {a.shape, d.shape, dt_bias.shape} != {(heads,)}):
        raise ValueError(f"mamba2 scan: x {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(b.shape)}, "
                         f"C {tuple(c.shape)}, A {tuple(a.shape)}, states {tuple(states.shape)} disagree")
    if states.dtype != torch.float32:
        raise ValueError(f"mamba2 states must be float32, got {states.dtype}")
    _check_slots(states, meta)
    chunked = kept is None and meta.max_query_len > CHUNK
    if x.is_cuda and not chunked:
        from jackfield.ops.recurrent_triton import mamba2_scan_triton

        return mamba2_scan_triton(x, dt, a, b, c, d, dt_bias, dt_limit, states, meta, kept)
    repeat = heads // b.shape[1]
    step = F.softplus(dt.float() + dt_bias.float()).clamp(*dt_limit)
    xp, sp = _padded(x.float(), meta), _padded(step, meta)  # padding: step 0 (decay 1, no input)
    bp = _padded(b.float(), meta).repeat_interleave(repeat, dim=2)
    cp = _padded(c.float(), meta).repeat_interleave(repeat, dim=2)
    state = _initial(states, meta, torch.float32)  # [B, H, P, N]
    if chunked:
        out, state = _mamba2_chunked(xp, sp, a.float(), bp, cp, state)
    else:
        decay = (sp * a.float()).exp()
        out = torch.empty_like(xp)
        rows = []
        for j in range(meta.max_query_len):
            update = (sp[:, j, :, None] * xp[:, j])[..., None] * bp[:, j, :, None, :]
            state = state * decay[:, j, :, None, None] + update
            out[:, j] = torch.einsum("bhpn,bhn->bhp", state, cp[:, j])
            if kept is not None and j < meta.kept_rows:
                rows.append(state[meta.keep_requests])
        if kept is not None and rows:
            kept.append(torch.stack(rows, dim=1))
    states[meta.state_slots] = state
    return _flat(out, meta) + d.float()[:, None] * x.float()


def _mamba2_chunked(x: torch.Tensor, step: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan over chunks of CHUNK rows (the SSD form; padded inputs [B, L, H, ...], state
    [B, H, P, N]): within a chunk from state S0, with G the cumulative sum of dt A,
    Y = exp(G) (C S0^T) + (exp(G_i - G_j) dt_j c_i.b_j)_{j <= i} X and
    S = exp(G_C) S0 + (dt exp(G_C - G) X)^T B. Zero rows (dt 0) change nothing."""
    xc, sc, bc, cc = (_chunks(t) for t in (x, step, b, c))  # [B, H, n, C, ...]
    start, to_end, pairwise = _decays(sc * a[:, None, None])
    attend = pairwise * (cc @ bc.transpose(-1, -2)) * sc[..., None, :]
    # the chunk scan's orientation: the state transposed, [B, H, N, P]
    out, state_t = _chunk_scan(start[..., None] * cc, attend, xc, None, (sc * to_end)[..., None] * bc,
                               start[..., -1], state.transpose(-1, -2).contiguous())
    return out.flatten(2, 3).movedim(1, 2)[:, : x.shape[1]], state_t.transpose(-1, -2)
