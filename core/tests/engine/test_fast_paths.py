"""The engine's fast paths against plain float64 references: routed experts (looped on the CPU,
grouped matmul on CUDA), the batched SDPA MLA prefill (whole prompts of mixed lengths, chunked
continuations, bidirectional), and the step's non-finite-logit check."""

from __future__ import annotations

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.attention.torch_ref import TorchRefMLAImpl
from jackfield.contracts.attention import AttentionMetadata
from jackfield.models.moe import Experts, use_grouped_mm
from jackfield.testing.problems import expanded_mla_reference, mla_layer


def _experts_reference(
    x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, chosen expert by chosen expert, in float64."""
    w13, w2 = experts.w13.double(), experts.w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = (w13[e] @ x[t].double()).chunk(2)
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _random_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str) -> Experts:
    experts = Experts(num_experts, hidden, inter, dtype).to(device)
    with torch.no_grad():
        experts.w13.normal_(0, hidden**-0.5)
        experts.w2.normal_(0, inter**-0.5)
    return experts


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_looped_experts_match_float64(tokens: int) -> None:
    torch.manual_seed(tokens)
    experts = _random_experts(6, 32, 24, torch.float32, "cpu")
    x = torch.randn(tokens, 32)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(tokens)])  # expert 5 may get no row
    weights = torch.rand(tokens, 3)
    assert not use_grouped_mm(x)
    got = experts(x, weights, ids)
    torch.testing.assert_close(
        got.double(), _experts_reference(x, experts, weights, ids), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("tokens", [1, 9])
def test_bf16_experts_take_routing_weights_of_any_float_dtype(tokens: int) -> None:
    """Granite MoE hands bf16 routing weights, DeepSeek float32: both combine in float32."""
    torch.manual_seed(20 + tokens)
    experts = _random_experts(6, 32, 24, torch.bfloat16, "cpu")
    x = torch.randn(tokens, 32).bfloat16()
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    want = _experts_reference(x.float(), experts, weights, ids)
    for w in (weights, weights.bfloat16()):
        got = experts(x, w, ids)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_grouped_experts_match_float64_on_cuda(tokens: int) -> None:
    torch.manual_seed(tokens)
    experts = _random_experts(16, 256, 128, torch.bfloat16, "cuda")
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(15)[:4] for _ in range(tokens)]).cuda()  # expert 15 never chosen
    weights = torch.rand(tokens, 4, device="cuda")
    assert use_grouped_mm(x)
    got = experts(x, weights, ids).double().cpu()
    want = _experts_reference(x.cpu().float(), experts.cpu(), weights.cpu(), ids.cpu())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


@pytest.mark.gpu
def test_grouped_experts_are_as_accurate_as_the_looped_path_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on CUDA: the grouped matmul's error against float64 is no worse than the per-expert
    F.linear path's (what transformers runs), at a realistic width. (On the H200 the engine's
    bf16 logprobs sat further from float32 than transformers' did; this isolates the experts.)"""
    torch.manual_seed(11)
    experts = _random_experts(16, 2048, 1024, torch.bfloat16, "cuda")
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(256)]).cuda()
    weights = torch.rand(256, 4, device="cuda")
    want = _experts_reference(x.cpu().float(), experts.cpu(), weights.cpu(), ids.cpu())
    experts.cuda()
    grouped = experts(x, weights, ids).double().cpu()
    monkeypatch.setattr("jackfield.models.moe.use_grouped_mm", lambda rows: False)
    looped = experts(x, weights, ids).double().cpu()
    grouped_err, looped_err = ((y - want).abs().mean().item() for y in (grouped, looped))
    assert grouped_err <= 1.5 * looped_err, (
        f"mean |error|: grouped {grouped_err:.3g}, looped {looped_err:.3g}"
    )


H, L, N, R, V, BLOCK = 3, 16, 8, 4, 6, 4
SPEC = mla_layer(num_heads=H, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=N, v_head_dim=V)


@pytest.mark.parametrize(
    "q_lens, seq_lens, causal",
    [
        ([5, 11, 2], [5, 11, 2], True),  # whole prompts of mixed lengths: the plain causal call
        ([3, 1, 6], [9, 5, 6], True),  # chunked continuations: the visibility mask
        ([4, 7], [4, 7], False),  # bidirectional
    ],
)
@pytest.mark.parametrize("unowned", ["random", "nan"])
def test_mla_prefill_matches_expanded_float64_attention(
    q_lens: list[int], seq_lens: list[int], causal: bool, unowned: str, rng_seed: int
) -> None:
    """Block 0, where padded keys point, belongs to no request: random values, or NaN, which the
    output must not notice."""
    g = torch.Generator().manual_seed(rng_seed)
    impl = TorchRefMLAImpl(SPEC)
    kv_b = torch.randn(H * (N + V), L, generator=g)
    impl.process_weights_after_loading({"kv_b_proj": kv_b})
    width = max(-(-s // BLOCK) for s in seq_lens)
    cache = torch.randn(1 + len(seq_lens) * width, BLOCK, L + R, generator=g)
    if unowned == "nan":
        cache[0] = float("nan")
    table = (1 + torch.randperm(len(seq_lens) * width, generator=g)).view(len(seq_lens), width).int()
    qsl = torch.tensor([0, *q_lens]).cumsum(0).int()
    metadata = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens).int(),
        block_table=table,
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=torch.tensor(seq_lens).int(),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        causal=causal,
    )
    q = torch.randn(sum(q_lens), H, N + R, generator=g)
    got = impl.prefill(q, cache, metadata)
    want = expanded_mla_reference(q, cache, metadata, kv_b, SPEC)  # from the checkpoint's kv_b_proj
    assert got.shape == (sum(q_lens), H, V) and got.dtype == q.dtype
    assert torch.isfinite(got).all(), "a value no request owns reached the output"
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_mla_prefill_rejects_a_short_block_table() -> None:
    impl = TorchRefMLAImpl(SPEC)
    impl.process_weights_after_loading({"kv_b_proj": torch.randn(H * (N + V), L)})
    qsl = torch.tensor([0, 9]).int()
    metadata = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor([9]).int(),
        block_table=torch.tensor([[0, 1]]).int(),
        slot_mapping=torch.zeros(9, dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=torch.tensor([9]).int(),
        max_query_len=9,
        max_seq_len=9,
    )
    with pytest.raises(ValueError, match="too few for seq_len 9"):
        impl.prefill(torch.randn(9, H, N + R), torch.randn(4, BLOCK, L + R), metadata)


@pytest.mark.parametrize("temperature", [0.0, 0.7])  # the greedy shortcut and the sampler
def test_non_finite_logits_fail_the_step(v3_dir, temperature: float) -> None:
    llm = LLM(v3_dir, backend="torch_ref", block_size=16)
    with torch.no_grad():
        llm.engine.model.model.norm.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="no finite logit"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=temperature, max_tokens=2))


def test_greedy_steps_match_the_sampler_and_mark_rows_with_no_finite_logit() -> None:
    from jackfield.contracts.sampler import SamplingMetadata
    from jackfield.engine.model_runner import greedy
    from jackfield.sampling.samplers import Murmur3Sampler

    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    logits[1, 7] = logits[1, 9] = 50.0  # a tie: the lowest index wins
    logits[2, :] = float("-inf")
    logits[3, 4] = float("nan")
    logits[4, 11] = float("inf")  # never chosen: not finite
    rows = logits.shape[0]
    meta = SamplingMetadata(
        temperature=torch.zeros(rows),
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seeds=torch.arange(rows),
        positions=torch.arange(rows),
    )
    want = Murmur3Sampler().sample(logits, meta)
    got = greedy(logits)
    assert want.invalid_rows.tolist() == [False, False, True, False, False]
    assert got.token_ids.tolist() == torch.where(want.invalid_rows, -1, want.token_ids).tolist()
    assert got.token_ids[1] == 7
    assert got.token_ids[3] != 4 and got.token_ids[4] != 11


def test_prefill_attention_never_asks_for_cudnn(v3_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's SDPA builds a plan per new shape (every new prompt length: ~65 ms on the H200, more
    than the whole prefill of the default model); the MLA prefill excludes it for every call."""
    import torch.nn.functional as F

    sdpa, cudnn_allowed = F.scaled_dot_product_attention, []

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    llm = LLM(str(v3_dir), **{"engine.device": "cpu", "engine.max_num_batched_tokens": 16})
    llm.generate([list(range(1, 30)), list(range(2, 9))], SamplingParams(temperature=0.0, max_tokens=2))
    assert cudnn_allowed and not any(cudnn_allowed)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process-wide setting is left alone
