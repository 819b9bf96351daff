"""The `murmur3` and `torch_ref` Samplers: logprobs, invalid rows, bias, allowed tokens, drafting."""

from __future__ import annotations

import re

import pytest
import torch
from jackfield.contracts.sampler import SamplingMetadata, SamplingParams
from jackfield.sampling import DRAFT_POSITION_OFFSET, sample
from jackfield.sampling.processors import bias_and_mask_from_params
from jackfield.sampling.samplers import Murmur3Sampler, TorchRefSampler
from jackfield.specs import resolve_factory


def metadata(rows: int, **kw) -> SamplingMetadata:
    g = torch.Generator().manual_seed(rows)
    base = dict(
        temperature=torch.rand(rows, generator=g) + 0.5,
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seeds=torch.randint(0, 2**62, (rows,), generator=g),
        positions=torch.randint(0, 2**20, (rows,), generator=g),
    )
    base.update(kw)
    return SamplingMetadata(**base)


SAMPLERS = [Murmur3Sampler, TorchRefSampler]


def test_builtin_factories_resolve_to_these_classes() -> None:
    assert resolve_factory("jackfield.sampling.samplers:Murmur3Sampler") is Murmur3Sampler
    assert resolve_factory("jackfield.sampling.samplers:TorchRefSampler") is TorchRefSampler


@pytest.mark.parametrize("cls", SAMPLERS)
def test_logprobs_are_the_top_k_of_log_softmax(cls: type) -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 2
    out = cls().sample(logits, metadata(5, max_num_logprobs=4))
    ref = torch.log_softmax(logits.double(), dim=-1)
    want_values, want_ids = ref.topk(4, dim=-1)
    assert torch.equal(out.logprob_token_ids, want_ids)
    torch.testing.assert_close(out.logprobs.double(), want_values, rtol=0, atol=1e-5)
    assert cls().sample(logits, metadata(5)).logprobs is None


@pytest.mark.parametrize("cls", SAMPLERS)
def test_invalid_rows_are_flagged(cls: type) -> None:
    logits = torch.randn(4, 50)
    logits[1] = float("nan")
    logits[3] = float("-inf")
    out = cls().sample(logits, metadata(4, temperature=torch.tensor([1.0, 1.0, 0.0, 0.0])))
    assert out.invalid_rows.tolist() == [False, True, False, True]
    assert ((out.token_ids >= 0) & (out.token_ids < 50)).all()


@pytest.mark.parametrize("cls", SAMPLERS)
def test_bias_and_allowed_tokens(cls: type) -> None:
    vocab = 40
    params = [
        SamplingParams(logit_bias={7: 100.0}),
        SamplingParams(allowed_token_ids=(3, 30)),
        SamplingParams(),
    ]
    bias, mask = bias_and_mask_from_params(params, vocab, torch.device("cpu"))
    logits = torch.randn(3, vocab)
    for trial in range(20):
        md = metadata(3, logit_bias=bias, allowed_token_mask=mask, positions=torch.full((3,), trial))
        tokens = cls().sample(logits, md).token_ids.tolist()
        assert tokens[0] == 7 and tokens[1] in (3, 30)


def test_bias_and_mask_errors() -> None:
    with pytest.raises(ValueError, match="outside the vocab"):
        bias_and_mask_from_params([SamplingParams(allowed_token_ids=(99,))], 10, torch.device("cpu"))
    md = metadata(2, logit_bias=torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="logit_bias must be torch.float32"):
        Murmur3Sampler().sample(torch.randn(2, 5), md)
    with pytest.raises(ValueError, match="allowed_token_ids must name at least one token"):
        SamplingParams(allowed_token_ids=())
    with pytest.raises(ValueError, match="logit_bias values must be finite"):
        SamplingParams(logit_bias={1: float("inf")})


def test_murmur3_sampler_is_sample_and_drafting_uses_the_disjoint_stream() -> None:
    logits = torch.randn(6, 500)
    md = metadata(6)
    out = Murmur3Sampler(impl="torch").sample(logits, md)
    direct = sample(
        logits, md.temperature, md.seeds, md.positions, md.top_k, md.top_p, md.min_p, impl="torch"
    )
    assert torch.equal(out.token_ids, direct)
    drafted = Murmur3Sampler(impl="torch").sample(logits, metadata(6, drafting=True))
    shifted = sample(logits, md.temperature, md.seeds, md.positions + DRAFT_POSITION_OFFSET, impl="torch")
    assert torch.equal(drafted.token_ids, shifted)


def test_torch_ref_is_reproducible_per_request_and_filters() -> None:
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(3))
    md = metadata(8, top_k=torch.full((8,), 3))
    a, b = TorchRefSampler().sample(logits, md), TorchRefSampler().sample(logits, md)
    assert torch.equal(a.token_ids, b.token_ids)
    alone = TorchRefSampler().sample(
        logits[2:3],
        metadata(
            1,
            **{
                k: getattr(md, k)[2:3]
                for k in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")
            },
        ),
    )
    assert alone.token_ids.item() == a.token_ids[2].item()
    top3 = logits.topk(3, dim=1).indices
    assert (top3 == a.token_ids.unsqueeze(1)).any(dim=1).all()
    greedy = TorchRefSampler().sample(logits, metadata(8, temperature=torch.zeros(8)))
    assert torch.equal(greedy.token_ids, logits.argmax(dim=1))


def test_torch_ref_rejects_bad_metadata() -> None:
    with pytest.raises(ValueError, match="seeds must have dtype torch.int64"):
        TorchRefSampler().sample(torch.randn(2, 5), metadata(2, seeds=torch.zeros(2, dtype=torch.int32)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"top_k": -2}, "top_k must be -1, 0 (off) or positive"),
    ],
)
def test_sampling_params_reject_out_of_range_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)
