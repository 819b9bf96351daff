"""Pin the oracle: torch_ref against a float64 dense formula written here, over a hand-filled cache.

Nothing here goes through the conformance kit or jackfield.ops: the expected values come from the
textbook definition (softmax(q·k * scale) over the visible keys, times v), position by position.
"""

import math

import pytest
import torch
from jackfield.attention import allocate_kv_cache
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, AttentionMetadata
from jackfield.models.attention import RoleImpls, StepContextBuilder

BLOCK = 4
Q_LENS, SEQ_LENS = [1, 2, 5], [6, 9, 5]  # a decode, a 2-token verify, a fresh prefill
TABLE = [[5, 0], [2, 7, 4], [1, 3]]  # shuffled physical blocks
K_SCALE, V_SCALE = 0.05, 0.02  # an MHA fp8 cache's per-tensor scales


def _metadata(causal: bool = True, num_decodes: int = 0) -> AttentionMetadata:
    qsl = torch.tensor([0, 1, 3, 8], dtype=torch.int32)
    seq = torch.tensor(SEQ_LENS, dtype=torch.int32)
    table = torch.tensor([row + [6] * (3 - len(row)) for row in TABLE], dtype=torch.int32)
    slots = [
        TABLE[b][p // BLOCK] * BLOCK + p % BLOCK
        for b in range(3)
        for p in range(SEQ_LENS[b] - Q_LENS[b], SEQ_LENS[b])
    ]
    return AttentionMetadata(
        qsl, seq, table, torch.tensor(slots), qsl, seq, 5, 9,
        num_decodes=num_decodes, num_decode_tokens=int(qsl[num_decodes]), causal=causal,
    )  # fmt: skip


def _expected(q, keys, values, scale, visible, sinks=None):
    """q [T,H,D] float64; keys/values[b] [S_b, H, D] per request (heads already expanded);
    visible(b, i, j) -> bool. Returns out [T,H,Dv], lse [T,H] by the definition."""
    num_heads, dv = q.shape[1], values[0].shape[-1]
    out = torch.zeros(q.shape[0], num_heads, dv, dtype=torch.float64)
    lse = torch.full((q.shape[0], num_heads), float("-inf"), dtype=torch.float64)
    row = 0
    for b, (q_len, seq_len) in enumerate(zip(Q_LENS, SEQ_LENS, strict=True)):
        for i in range(q_len):
            for h in range(num_heads):
                js = [j for j in range(seq_len) if visible(b, i, j)]
                if not js:
                    continue
                logits = [scale * float(q[row, h] @ keys[b][j, h]) for j in js]
                denom = sum(math.exp(x) for x in logits) + (
                    math.exp(float(sinks[h])) if sinks is not None else 0.0
                )
                for j, x in zip(js, logits, strict=True):
                    out[row, h] += math.exp(x) / denom * values[b][j, h]
                lse[row, h] = math.log(denom)
            row += 1
    return out, lse


def _causal(window=None):
    def visible(b, i, j):
        pos = SEQ_LENS[b] - Q_LENS[b] + i
        return j <= pos and (window is None or j > pos - window)

    return visible


def _mha_setup(kv_cache_dtype="auto", window=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    layer = AttentionLayerSpec(
        num_heads=4,
        head_size=8,
        scale=0.4,
        num_kv_heads=2,
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=window,
    )
    cache = allocate_kv_cache(layer, 8, BLOCK, dtype, "cpu")
    keys, values = [], []
    for b, seq_len in enumerate(SEQ_LENS):
        k, v = torch.randn(seq_len, 2, 8, generator=g), torch.randn(seq_len, 2, 8, generator=g)
        for p in range(seq_len):  # fill by hand: block table -> physical block, offset
            blk = TABLE[b][p // BLOCK]
            if cache.dtype == torch.float8_e4m3fn:  # keys and values each by their own scale
                k[p], v[p] = (
                    (k[p] / K_SCALE).to(cache.dtype).double() * K_SCALE,
                    (v[p] / V_SCALE).to(cache.dtype).double() * V_SCALE,
                )
                cache[0, blk, p % BLOCK], cache[1, blk, p % BLOCK] = (
                    (k[p] / K_SCALE).to(cache.dtype),
                    (v[p] / V_SCALE).to(cache.dtype),
                )
            else:
                cache[0, blk, p % BLOCK], cache[1, blk, p % BLOCK] = k[p].to(dtype), v[p].to(dtype)
        keys.append(k.to(dtype).double().repeat_interleave(2, dim=1))
        values.append(v.to(dtype).double().repeat_interleave(2, dim=1))
    q = torch.randn(8, 4, 8, generator=g).to(dtype)
    return layer, cache, q, keys, values


@pytest.mark.parametrize("window", [None, 2])
def test_mha_causal_gqa_and_window(window) -> None:
    layer, cache, q, keys, values = _mha_setup(window=window)
    got = TorchRefBackend.make_impl(layer).attend(q, cache, _metadata(), return_lse=True)
    want, want_lse = _expected(q.double(), keys, values, 0.4, _causal(window))
    torch.testing.assert_close(got.out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_mha_non_causal_sinks_bf16() -> None:
    layer, cache, q, keys, values = _mha_setup(dtype=torch.bfloat16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    got = TorchRefBackend.make_impl(layer).attend(
        q, cache, _metadata(causal=False), sinks=sinks, return_lse=True
    )
    want, want_lse = _expected(q.double(), keys, values, 0.4, lambda b, i, j: True, sinks)
    assert got.out.dtype == torch.bfloat16
    torch.testing.assert_close(got.out.double(), want, atol=1e-2, rtol=1e-2)  # only the bf16 output rounding
    torch.testing.assert_close(got.lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_mha_fp8_cache_dequantizes_with_scale() -> None:
    layer, cache, q, keys, values = _mha_setup(kv_cache_dtype="fp8_e4m3")
    got = TorchRefBackend.make_impl(layer).attend(q, cache, _metadata(),
                                                  kv_scale=torch.tensor([K_SCALE, V_SCALE]))
    want, _ = _expected(q.double(), keys, values, 0.4, _causal())
    torch.testing.assert_close(got.out.double(), want, atol=1e-5, rtol=1e-5)


def test_sparse_topk_attends_exactly_the_listed_positions() -> None:
    layer, cache, q, keys, values = _mha_setup()
    chosen = [
        [0, 5, 2],
        [8, -1, -1],
        [-1, -1, -1],
        [0, 1, -1],
        [4, -1, -1],
        [3, 0, 2],
        [1, 4, -1],
        [2, -1, -1],
    ]
    topk = torch.tensor(chosen, dtype=torch.int32)
    got = TorchRefBackend.make_impl(layer).attend(q, cache, _metadata(), topk_indices=topk, return_lse=True)
    row_of = lambda b, i: [0, 1, 3][b] + i  # noqa: E731
    want, want_lse = _expected(q.double(), keys, values, 0.4, lambda b, i, j: j in chosen[row_of(b, i)])
    torch.testing.assert_close(got.out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.out[2], torch.zeros(4, 8)) and bool((got.lse[2] == float("-inf")).all())


@pytest.mark.parametrize("num_decodes", [0, 1, 2, 3])
def test_mla_forward_matches_expanded_float64_attention(num_decodes: int) -> None:
    """Whatever rows go absorbed (decode) or expanded (prefill), the layer's attention through the
    engine's role split (StepContextBuilder, RoleImpls) equals the HF-style computation:
    kv = kv_b_proj(kv_c) split into k_nope, v; k = k_nope ‖ k_pe; softmax(q·k)·v."""
    g = torch.Generator().manual_seed(2)
    h, lat, n, r, dv = 3, 16, 8, 4, 6
    layer = AttentionLayerSpec(
        num_heads=h,
        head_size=lat + r,
        scale=0.3,
        kv_lora_rank=lat,
        qk_nope_head_dim=n,
        qk_rope_head_dim=r,
        v_head_dim=dv,
    )
    backends = AttentionBackends(prefill=TorchRefBackend, decode=TorchRefBackend)
    impl = RoleImpls(backends, layer)
    w = torch.randn(h * (n + dv), lat, generator=g) * 0.3
    impl.process_weights_after_loading({"kv_b_proj": w})
    cache = allocate_kv_cache(layer, 8, BLOCK, torch.float32, "cpu")
    step = StepContextBuilder(backends, [layer], [0]).build([cache], [_metadata(num_decodes=num_decodes)])
    assert [part.role for part in step.parts(0)] == [*(["decode"] if num_decodes else []),
                                                     *(["prefill"] if num_decodes < 3 else [])]
    kv_c = [torch.randn(s, lat, generator=g) for s in SEQ_LENS]
    k_pe = [torch.randn(s, r, generator=g) for s in SEQ_LENS]
    ctx = [TABLE[b][p // BLOCK] * BLOCK + p % BLOCK for b in range(3) for p in range(SEQ_LENS[b] - Q_LENS[b])]
    new = [torch.arange(s - q, s) for q, s in zip(Q_LENS, SEQ_LENS, strict=True)]
    old = [torch.arange(0, s - q) for q, s in zip(Q_LENS, SEQ_LENS, strict=True)]
    impl.decode_impl.write_kv(
        cache,
        torch.tensor(ctx),
        torch.cat([c[i] for c, i in zip(kv_c, old, strict=True)]),
        torch.cat([p[i] for p, i in zip(k_pe, old, strict=True)]),
    )
    q = torch.randn(8, h, n + r, generator=g)
    out = impl.run(
        step,
        0,
        q,
        torch.cat([c[i] for c, i in zip(kv_c, new, strict=True)]),
        torch.cat([p[i] for p, i in zip(k_pe, new, strict=True)]),
    )
    keys, values = [], []
    for b in range(3):
        kv = (kv_c[b].double() @ w.double().T).view(-1, h, n + dv)
        keys.append(torch.cat([kv[..., :n], k_pe[b].double()[:, None, :].expand(-1, h, r)], dim=-1))
        values.append(kv[..., n:])
    want, _ = _expected(q.double(), keys, values, 0.3, _causal())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
