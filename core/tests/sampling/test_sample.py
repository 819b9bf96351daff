"""sample(): PyTorch and Triton agree bit for bit; greedy, filters, invalid rows, invariance, errors."""

from __future__ import annotations

import os

import pytest
import torch
from jackfield.sampling import sample
from jackfield.sampling.sample import resolve_impl, sample_with_scores

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton_here = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="Triton needs CUDA or TRITON_INTERPRET=1"
)


def make_batch(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    temperature[::3] = 0.0
    return {
        "logits": logits.to(DEVICE),
        "temperature": temperature.to(DEVICE),
        "seeds": torch.randint(0, 2**63 - 1, (rows,), generator=g).to(DEVICE),
        "positions": torch.randint(0, 2**31, (rows,), generator=g).to(DEVICE),
    }


def both(
    batch: dict, block: int | None = None, **kw
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    return sample_with_scores(**batch, **kw, impl="torch"), sample_with_scores(
        **batch, **kw, impl="triton", block=block
    )


def assert_identical(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))  # bit for bit, -inf included


@needs_triton_here
@pytest.mark.parametrize("vocab", [1, 999, 1024, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_torch_bit_for_bit(vocab: int, dtype: torch.dtype) -> None:
    batch = make_batch(6, vocab, seed=vocab, dtype=dtype)
    batch["logits"][1, : vocab // 2] = float("nan")
    batch["logits"][4, vocab // 3 :] = float("-inf")
    torch_out, triton_out = both(batch)
    assert_identical(torch_out, triton_out)
    assert ((torch_out[0] >= 0) & (torch_out[0] < vocab)).all()


@needs_triton_here
def test_noise_bits_match_through_the_score() -> None:
    """Vocab 3 over many rows: each winning score exposes one noise value, compared bit for bit."""
    batch = make_batch(48, 3, seed=7)
    batch["temperature"] = torch.full((48,), 0.75, device=DEVICE)
    assert_identical(*both(batch, block=4))


@needs_triton_here
def test_filters_match_bit_for_bit() -> None:
    batch = make_batch(8, 777, seed=11)
    top_k = torch.tensor([0, 5, 50, 0, 1, 776, 3, 0], device=DEVICE)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 1.0, 0.95, 1.0, 0.8], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.2, 0.0, 0.05, 0.3], device=DEVICE)
    assert_identical(*both(batch, top_k=top_k, top_p=top_p, min_p=min_p))


@needs_triton_here
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_invalid_rows_return_an_in_range_token(impl: str) -> None:
    batch = make_batch(4, 300, seed=3)
    batch["temperature"] = torch.tensor([1.0, 0.0, 1.0, 0.0], device=DEVICE)
    batch["logits"][0] = float("nan")
    batch["logits"][1] = float("-inf")
    batch["logits"][2] = float("-inf")
    tokens, scores = sample_with_scores(**batch, impl=impl, top_k=torch.tensor([5, 0, 0, 0], device=DEVICE))
    assert tokens[:3].tolist() == [0, 0, 0]
    assert (scores[:3] == float("-inf")).all() and torch.isfinite(scores[3])


@needs_triton_here
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_greedy_is_the_exact_argmax_with_lowest_index_on_ties(impl: str) -> None:
    batch = make_batch(5, 2000, seed=5)
    batch["temperature"].zero_()
    logits = batch["logits"]
    logits[2, [17, 900, 1999]] = 1e4  # a three-way tie: the lowest index wins
    logits[3, 5] = float("nan")  # NaN is never picked, even by argmax
    want = torch.where(torch.isnan(logits.double()), float("-inf"), logits.double()).argmax(dim=1)
    got = sample(**batch, impl=impl)
    assert got.tolist() == want.tolist() and got[2].item() == 17


@needs_triton_here
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_single_finite_token_is_always_sampled(impl: str) -> None:
    rows = 16  # the interpreter runs each row's programs: a few rows, each its own finite index
    batch = make_batch(rows, 999, seed=9)
    batch["temperature"] = torch.full((rows,), 2.0, device=DEVICE)
    only = torch.randint(0, 999, (rows,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    batch["logits"].fill_(float("-inf"))
    batch["logits"][torch.arange(rows, device=DEVICE), only] = -50.0
    assert torch.equal(sample_with_scores(**batch, impl=impl, block=128)[0], only)


@needs_triton_here
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_tokens_do_not_depend_on_batch_company_or_order(impl: str) -> None:
    batch = make_batch(12, 1500, seed=21)
    alone = torch.cat([sample(**{k: v[i : i + 1] for k, v in batch.items()}, impl=impl) for i in range(12)])
    together = sample(**batch, impl=impl)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    shuffled = sample(**{k: v[order] for k, v in batch.items()}, impl=impl)
    assert torch.equal(alone, together) and torch.equal(shuffled, together[order])


@needs_triton_here
def test_tokens_do_not_depend_on_the_vocab_block_size() -> None:
    batch = make_batch(6, 3001, seed=31)
    outs = [sample_with_scores(**batch, impl="triton", block=b) for b in (64, 256, 1024, 4096)]
    for out in outs[1:]:
        assert_identical(outs[0], out)


def test_non_contiguous_logits_are_accepted() -> None:
    batch = make_batch(4, 200, seed=2)
    wide = torch.randn(4, 400, device=DEVICE)
    wide[:, ::2] = batch["logits"]
    strided = dict(batch, logits=wide[:, ::2])
    assert torch.equal(sample(**strided, impl="torch"), sample(**batch, impl="torch"))


@needs_triton_here
def test_strided_per_row_tensors_give_the_dense_result() -> None:
    """Per-row values handed as views (every other element of a wider tensor)."""
    batch = make_batch(6, 300, seed=4)
    filters = {
        "top_k": torch.tensor([0, 3, 1, 5, 0, 2]),
        "top_p": torch.full((6,), 0.8),
        "min_p": torch.full((6,), 0.05),
    }
    dense = dict(batch, **{k: v.to(DEVICE) for k, v in filters.items()})
    strided = {
        k: torch.stack([v, torch.zeros_like(v)], dim=1)[:, 0]
        for k, v in dense.items()
        if k not in ("logits",)
    }
    strided["logits"] = batch["logits"]
    assert all(strided[k].stride(0) == 2 for k in strided if k != "logits")
    want = sample_with_scores(**dense, impl="torch")
    for impl in ("torch", "triton"):
        assert_identical(sample_with_scores(**strided, impl=impl), want)


@needs_triton_here
def test_out_of_range_values_are_defined_and_identical_on_both_paths() -> None:
    """Temperatures below 1e-5, negative or NaN are greedy; +inf samples the noise alone; min_p
    above 1 keeps the most likely token (it never masks the argmax); a NaN top_p is off."""
    batch = make_batch(6, 300, seed=5)
    logits = batch["logits"]
    temperature = torch.tensor([1e-38, 1e-6, -1.0, float("nan"), float("inf"), 0.7], device=DEVICE)
    kw = dict(
        batch,
        temperature=temperature,
        top_p=torch.tensor([0.5, 1, 1, float("nan"), 0.9, 0.9], device=DEVICE),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.5], device=DEVICE),
        top_k=torch.tensor([8] * 6, device=DEVICE),
    )
    torch_result, triton_result = (sample_with_scores(**kw, impl=impl) for impl in ("torch", "triton"))
    assert_identical(torch_result, triton_result)
    tokens, scores = torch_result
    argmax = logits.argmax(dim=1)
    assert torch.equal(tokens[:4], argmax[:4])  # greedy rows
    assert torch.isfinite(scores).all()
    assert tokens[5] == argmax[5]  # min_p 1.5 acts as 1: only the most likely token survives


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    batch = make_batch(32, 500, seed=4)
    batch["temperature"].fill_(1.0)
    a, b = sample(**batch, impl="torch"), sample(**batch, impl="torch")
    other = sample(**dict(batch, seeds=batch["seeds"] + 1), impl="torch")
    assert torch.equal(a, b) and not torch.equal(a, other)


def _valid() -> dict:
    return make_batch(3, 10, seed=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logits": torch.zeros(3, 10, dtype=torch.int32)}, "logits must be float32, bfloat16 or float16"),
        ({"logits": torch.randn(3, 10, 2)}, "logits must be 2-D"),
        ({"logits": torch.randn(3, 0)}, "at least one token"),
        ({"temperature": torch.ones(3, dtype=torch.float64)}, "temperature must have dtype torch.float32"),
        ({"temperature": torch.ones(4)}, "temperature must have shape (3,)"),
        ({"seeds": torch.ones(3, dtype=torch.int32)}, "seeds must have dtype torch.int64"),
        ({"positions": torch.ones(2, dtype=torch.int64)}, "positions must have shape (3,)"),
        ({"top_k": torch.ones(3)}, "top_k must have dtype"),
        ({"top_p": torch.ones(3, dtype=torch.float16)}, "top_p must have dtype torch.float32"),
        ({"min_p": [0.1, 0.1, 0.1]}, "min_p must be a torch.Tensor"),
        ({"logits": "not a tensor"}, "logits must be a torch.Tensor"),
    ],
)
def test_bad_inputs_are_rejected(change: dict, message: str) -> None:
    args = {k: v.cpu() for k, v in _valid().items()}
    args.update(change)
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        sample(**args, impl="torch")


@pytest.mark.gpu
def test_tensors_on_another_device_are_rejected() -> None:
    args = _valid()
    args["seeds"] = args["seeds"].cpu()
    with pytest.raises(ValueError, match="seeds is on cpu but logits are on cuda"):
        sample(**args)


def test_device_mismatch_is_rejected_on_cpu_too() -> None:
    args = {k: v.cpu() for k, v in _valid().items()}
    args["positions"] = args["positions"].to("meta")
    with pytest.raises(ValueError, match="positions is on meta but logits are on cpu"):
        sample(**args, impl="torch")


def test_impl_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="impl must be 'auto', 'torch' or 'triton'"):
        resolve_impl("cuda", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA logits, or TRITON_INTERPRET=1"):
        resolve_impl("triton", torch.device("cpu"))


@pytest.mark.gpu
def test_bit_exact_at_benchmark_size_on_gpu() -> None:
    batch = make_batch(256, 129280, seed=0)
    assert resolve_impl("auto", batch["logits"].device) == "triton"
    assert_identical(*both(batch))
    top_k = torch.full((256,), 50, device=DEVICE)
    top_p = torch.full((256,), 0.9, device=DEVICE)
    assert_identical(*both(batch, top_k=top_k, top_p=top_p))
    cpu = sample_with_scores(**{k: v.cpu() for k, v in batch.items()}, impl="torch")
    assert_identical(tuple(t.cpu() for t in sample_with_scores(**batch, impl="triton")), cpu)  # CPU == GPU


@pytest.mark.gpu
def test_direct_launches_match_triton_s_own_launches_on_gpu(rng_seed: int) -> None:
    """Kept compiled kernels launched directly (launch.py) give the bits of Triton's own path,
    for every kernel of both paths, also for unaligned views (another specialization)."""
    import triton
    from jackfield.sampling import filters_triton, gumbel_triton

    def no_hook(metadata: object) -> None:
        """Installed as a launch hook (as a profiler's), it sends every launch through Triton."""

    launchers = [
        gumbel_triton.launch_approx_maxima,
        gumbel_triton.launch_exact_rows,
        filters_triton.launch_group_max,
        filters_triton.launch_filter_and_sample,
    ]
    batch = make_batch(37, 50_001, seed=rng_seed)
    wide = torch.randn(37, 50_002, device=DEVICE) * 3
    wide[:, 1:] = batch["logits"]
    unaligned = dict(batch, logits=wide[:, 1:])  # 4 bytes past a 16-byte boundary, odd row stride
    top_k = torch.randint(1, 100, (37,), device=DEVICE)
    top_p = torch.rand(37, device=DEVICE) * 0.5 + 0.5
    for b in (batch, unaligned):
        for filters in ({}, {"top_k": top_k, "top_p": top_p}):
            triton.knobs.runtime.launch_enter_hook.add(no_hook)
            try:
                want = sample_with_scores(**b, **filters, impl="triton")
            finally:
                triton.knobs.runtime.launch_enter_hook.remove(no_hook)
            before = [launcher.direct_launches for launcher in launchers]
            for _ in range(3):  # the first may compile or keep; the others launch directly
                got = sample_with_scores(**b, **filters, impl="triton")
                assert_identical(got, want)
            used = [launcher.direct_launches - n for launcher, n in zip(launchers, before, strict=True)]
            assert used == ([2, 2, 2, 2] if filters else [2, 2, 0, 0])  # greedy rows: whole-row kernels too
    assert_identical(
        sample_with_scores(**unaligned, impl="triton"), sample_with_scores(**unaligned, impl="torch")
    )
