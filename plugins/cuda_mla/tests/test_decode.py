"""Split-KV MLA decode (dense, causal / non-causal, fp8, sparse) vs a float64 reference.

Small shapes (kv_lora_rank 64, rope 16) so the CPU interpreter runs them in CI; fp16/fp32 only
here because the interpreter mishandles bf16 tl.dot (bf16 is covered on the GPU).
"""

from __future__ import annotations

import pytest
import torch
from jackfield.ops.merge import merge_attn_states
from jackfield_cuda_mla.kernels import decode, mla_decode
from jackfield_cuda_mla.kernels.decode import DecodeConfig
from jackfield_cuda_mla.testing import decode_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RANK, ROPE, PAGE, HEADS = 64, 16, 16, 4
FP8 = torch.float8_e4m3fn
TOL = {torch.float16: 2e-3, torch.float32: 1e-4, torch.bfloat16: 2e-2}


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    heads: int = HEADS,
    rank: int = RANK,
    rope: int = ROPE,
    page: int = PAGE,
):
    max_blocks = max(1, -(-max(seq_lens) // page))
    num_blocks = len(seq_lens) * max_blocks + 3
    block_table = torch.randperm(num_blocks)[: len(seq_lens) * max_blocks].reshape(len(seq_lens), max_blocks)
    cache = torch.randn(num_blocks, page, rank + rope)
    scale = None
    if cache_dtype == FP8:
        scale = torch.tensor([0.02])
        cache = (cache / scale).clamp(-448, 448).to(FP8)
    else:
        cache = cache.to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), heads, rank + rope).to(dtype)
    return {
        "query": query.to(DEV),
        "kv_cache": cache.to(DEV),
        "block_table": block_table.int().to(DEV),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        "query_start_loc": qsl.to(DEV),
        "kv_scale": None if scale is None else scale.to(DEV),
    }


def run_decode(
    batch: dict, causal: bool = True, topk: torch.Tensor | None = None, rank: int = RANK, **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    query = batch["query"]
    out = torch.full((*query.shape[:2], rank), float("nan"), dtype=query.dtype, device=DEV)
    lse = torch.full(query.shape[:2], float("nan"), device=DEV)
    q_lens = batch["query_start_loc"].diff()
    mla_decode(
        query,
        batch["kv_cache"],
        batch["block_table"],
        batch["seq_lens"],
        batch["query_start_loc"],
        max_query_len=int(q_lens.max()),
        max_seq_len=int(batch["seq_lens"].max()),
        sm_scale=0.125,
        kv_lora_rank=rank,
        causal=causal,
        kv_scale=batch["kv_scale"],
        topk_indices=topk,
        out=out,
        lse=lse,
        **kw,
    )
    return out, lse


def reference(batch: dict, causal: bool = True, topk: torch.Tensor | None = None, rank: int = RANK):
    return decode_reference(batch, 0.125, rank, causal=causal, topk_indices=topk)


def assert_close(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, tol: float
) -> None:
    assert not out.isnan().any() and not lse.isnan().any(), "an output element was not written"
    assert (out.cpu().double() - ref_out).abs().max().item() <= tol
    finite = ref_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), finite)
    assert (lse.cpu().double()[finite] - ref_lse[finite]).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_dense_decode_matches_float64(dtype: torch.dtype, causal: bool, splits: int | None) -> None:
    batch = make_batch([37, 80, 5, 16, 64], [1, 8, 2, 3, 1], dtype)
    out, lse = run_decode(batch, causal, num_splits=splits)
    assert_close(out, lse, *reference(batch, causal), TOL[dtype])


@pytest.mark.parametrize(("rank", "rope", "page"), [(32, 8, 16), (32, 8, 64), (8, 16, 16)])
def test_latents_and_ropes_narrower_than_a_dot_are_padded(rank: int, rope: int, page: int) -> None:
    """tl.dot needs K >= 16: a rope of 8 (the engine's tiny test models) or a latent of 8 runs
    padded (with 64-key pages too, where the TMA tile path would otherwise take it)."""
    batch = make_batch([37, 80, 5], [1, 4, 2], torch.float16, rank=rank, rope=rope, page=page)
    out, lse = run_decode(batch, True, rank=rank)
    assert_close(out, lse, *reference(batch, True, rank=rank), TOL[torch.float16])


@pytest.mark.parametrize("splits", [None, 2])
def test_without_gluon_every_call_takes_the_triton_kernel(monkeypatch: pytest.MonkeyPatch, splits) -> None:
    """A Triton without the Gluon kernels (e.g. 3.5): decode.py holds None for both modules, and a
    config that asks for Gluon still decodes, on the tl kernel."""
    monkeypatch.setattr(decode, "decode_gluon_few", None)
    monkeypatch.setattr(decode, "decode_gluon_many", None)
    batch = make_batch([37, 80], [1, 2], torch.float16)
    out, lse = run_decode(batch, True, num_splits=splits, config=DecodeConfig(16, 16, 4, 1, gluon=True))
    assert_close(out, lse, *reference(batch, True), 2e-3)


def test_many_heads_span_several_row_blocks() -> None:
    batch = make_batch([45, 33], [2, 1], torch.float16, heads=40)  # 80 rows: two 64-row blocks
    out, lse = run_decode(batch, True)
    assert_close(out, lse, *reference(batch, True), TOL[torch.float16])


def test_request_without_kv_gives_zero_and_minus_inf_exactly() -> None:
    batch = make_batch([0, 20], [1, 1], torch.float16)
    out, lse = run_decode(batch, causal=False, num_splits=2)
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
    assert bool((lse[0] == float("-inf")).all())
    assert_close(out, lse, *reference(batch, False), TOL[torch.float16])


def test_fp8_cache_dequantizes_with_the_scale() -> None:
    batch = make_batch([70, 19], [2, 1], torch.float16, cache_dtype=FP8)
    out, lse = run_decode(batch, True, num_splits=2)
    assert_close(out, lse, *reference(batch, True), TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sparse_topk_decode(dtype: torch.dtype) -> None:
    seq_lens, q_lens = [60, 90, 30], [2, 1, 2]
    batch = make_batch(seq_lens, q_lens, dtype)
    rows = []
    for seq_len, q_len in zip(seq_lens, q_lens, strict=True):
        for _ in range(q_len):
            row = torch.randperm(seq_len)[:24].int()
            row[torch.rand(row.numel()) < 0.3] = -1
            rows.append(torch.cat([row, torch.full((24 - row.numel(),), -1, dtype=torch.int32)]))
    topk = torch.stack(rows)
    topk[1] = -1  # a row with no keys: output 0, LSE -inf exactly
    topk = topk.to(DEV)
    out, lse = run_decode(batch, topk=topk, num_splits=2)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu())) and bool((lse[1] == float("-inf")).all())
    assert_close(out, lse, *reference(batch, topk=topk), TOL[dtype])


def test_lse_merge_of_two_kv_shards_equals_the_whole() -> None:
    """Decode context parallel: each rank attends a shard of the keys; the LSE merge recovers the whole."""
    seq_len = 64
    batch = make_batch([seq_len], [1], torch.float32)
    whole_out, whole_lse = run_decode(batch, causal=False)
    halves = []
    for lo in (0, seq_len // 2):  # shard = a request whose block table holds half the blocks
        shard = dict(
            batch,
            block_table=batch["block_table"][:, lo // PAGE : (lo + seq_len // 2) // PAGE].contiguous(),
            seq_lens=torch.tensor([seq_len // 2], dtype=torch.int32, device=DEV),
        )
        halves.append(run_decode(shard, causal=False))
    merged_out, merged_lse = merge_attn_states(
        halves[0][0].float(), halves[0][1], halves[1][0].float(), halves[1][1]
    )
    assert (merged_out - whole_out.float()).abs().max().item() < 1e-4
    assert (merged_lse - whole_lse).abs().max().item() < 1e-4


def poison_unowned_rows(batch: dict) -> None:
    """NaN in every cache row past a request's seq_len: a loader that reads one fails the test."""
    cache = batch["kv_cache"]
    bits = cache.view(torch.uint8 if cache.element_size() == 1 else torch.int16)
    nan = torch.tensor(float("nan")).to(cache.dtype).view(bits.dtype)
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for pages, seq_len in zip(batch["block_table"].cpu(), batch["seq_lens"].cpu().tolist(), strict=True):
        owned.view(-1)[(pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:seq_len]] = True
    bits[~owned.to(DEV)] = nan


@pytest.mark.parametrize(
    "prefetch,tma,swap",
    [
        (True, False, False),
        (False, True, False),
        (True, True, False),
        (False, False, True),
        (True, False, True),
        (False, True, True),
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_tile_loaders_agree_with_float64(
    prefetch: bool, tma: bool, swap: bool, cache_dtype: torch.dtype
) -> None:
    """Register prefetch, TMA pages (whole tiles; the partial tail goes through the gather) and
    the swapped products (keys as M), each with q_len up to 4 (16 rows of 4 heads)."""
    batch = make_batch([37, 80, 5, 16, 64, 0], [1, 4, 2, 3, 1, 1], torch.float16, cache_dtype)
    poison_unowned_rows(batch)
    stages = 2 if swap else 1  # the interpreter ignores stages; swap requires >= 2
    config = DecodeConfig(
        block_m=16, block_n=16, num_warps=4, num_stages=stages, prefetch=prefetch, tma=tma, swap=swap
    )
    for causal, splits in ((True, 1), (False, 3)):
        out, lse = run_decode(batch, causal, num_splits=splits, config=config)
        assert_close(out, lse, *reference(batch, causal), TOL[torch.float16])
