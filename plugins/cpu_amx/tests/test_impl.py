"""The MLA layer through cpu_amx (weights, absorbed decode + expanded prefill) and the error paths."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.testing.conformance import forward_by_role
from jackfield.testing.problems import mha_layer, mla_layer
from jackfield_cpu_amx.backend import CpuAmxBackend, CpuAmxMHAImpl, CpuAmxMLAImpl
from jackfield_cpu_amx.plan import PLANS_KEY, CpuAmxMetadataBuilder
from jackfield_cpu_amx.testing import make_problem


@pytest.mark.parametrize(
    "path,dtype,tol",
    [
        ("avx512_fp32", torch.float32, 1e-4),
        ("amx_bf16", torch.float32, 1e-4),  # a float32 request stays float32 on the AMX path
        ("amx_bf16", torch.bfloat16, 3e-2),
    ],
)
def test_forward_matches_torch_ref(path: str, dtype: torch.dtype, tol: float) -> None:
    """Decodes (absorbed, W_UK/W_UV as head-batched products) then prefills, vs the reference layer."""
    layer = mla_layer(num_heads=8)
    problem = make_problem(layer, [1, 2, 6, 4], [9, 21, 6, 13], 4, dtype, num_decodes=2, seed=11)
    gen = torch.Generator().manual_seed(5)
    kv_b_proj = torch.randn(8 * (32 + 32), 64, generator=gen) / 8
    num_tokens = problem.query.shape[0]
    q = torch.randn(num_tokens, 8, 32 + 16, generator=gen).to(dtype)
    kv_c = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    k_pe = torch.randn(num_tokens, 16, generator=gen).to(dtype)
    qsl, seq = problem.metadata.query_start_loc_cpu, problem.metadata.seq_lens_cpu
    block_size = problem.kv_cache.shape[1]
    slots = [
        int(problem.metadata.block_table[b, p // block_size]) * block_size + p % block_size
        for b in range(4)
        for p in range(int(seq[b]) - int(qsl[b + 1] - qsl[b]), int(seq[b]))
    ]
    metadata = problem.metadata.replace(slot_mapping=torch.tensor(slots))
    outs = []
    for backend, impl in (
        (CpuAmxBackend, CpuAmxMLAImpl(layer, path=path)),
        (TorchRefBackend, TorchRefBackend.make_impl(layer)),
    ):
        impl.process_weights_after_loading({"kv_b_proj": kv_b_proj})
        # as the engine runs the layer: decodes and prefills in separate calls, each half's
        # metadata from its own builder
        cache = problem.kv_cache.clone()
        outs.append(forward_by_role(backend, impl, q, (kv_c, k_pe), cache, metadata, None, None))
    assert outs[0].dtype == dtype and not outs[0].isnan().any()
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


@pytest.fixture
def decode_case():
    layer = mla_layer(num_heads=4)
    problem = make_problem(layer, [1, 1], [10, 6], 4, torch.float32, seed=2)
    impl = CpuAmxMLAImpl(layer, path="avx512_fp32")
    return impl, problem, CpuAmxBackend.metadata_builder().build(problem.metadata)


def test_rejects_topk(decode_case) -> None:
    impl, p, md = decode_case
    with pytest.raises(ValueError, match="does not support topk_indices"):
        impl.attend(p.query, p.kv_cache, md, topk_indices=torch.zeros(2, 3, dtype=torch.int32))


def test_rejects_fp8_and_half_caches(decode_case) -> None:
    impl, p, md = decode_case
    with pytest.raises(ValueError, match="bfloat16 or float32 caches"):
        impl.attend(p.query, p.kv_cache.half(), md)
    fp8 = p.kv_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="bfloat16 or float32 caches"):
        impl.attend(p.query, fp8, md, kv_scale=torch.ones(1))


def test_metadata_without_a_plan_gets_one_for_the_call(decode_case) -> None:
    impl, p, md = decode_case
    planned = impl.attend(p.query, p.kv_cache, md, return_lse=True)
    direct = impl.attend(p.query, p.kv_cache, p.metadata, return_lse=True)
    assert torch.equal(planned.out, direct.out) and torch.equal(planned.lse, direct.lse)


def test_rejects_a_plan_for_other_rows(decode_case) -> None:
    impl, p, _ = decode_case
    md = CpuAmxMetadataBuilder(group_keys=1).build(p.metadata)  # a group per request
    plans = md.extra[PLANS_KEY]
    ((key, plan),) = plans.items()
    # A consistent plan, for the first request's row alone (a plan's groups must tile its rows).
    first = dataclasses.replace(plan, groups=plan.groups[:1], num_reqs=1, num_tokens=1)
    stale = md.replace(extra={**md.extra, PLANS_KEY: {key: first}})
    with pytest.raises(ValueError, match="plan covers 1 query rows, got 2"):
        impl.attend(p.query, p.kv_cache, stale)


def test_rejects_block_ids_outside_the_cache(decode_case) -> None:
    impl, p, _ = decode_case
    table = p.metadata.block_table.clone()
    table[1, 0] = p.kv_cache.shape[0]
    md = CpuAmxBackend.metadata_builder().build(p.metadata.replace(block_table=table))
    with pytest.raises(ValueError, match="the cache has"):
        impl.attend(p.query, p.kv_cache, md)


def test_rejects_wrong_query_shape_and_dtype(decode_case) -> None:
    impl, p, md = decode_case
    with pytest.raises(ValueError, match="query must be"):
        impl.attend(p.query[:, :3], p.kv_cache, md)
    with pytest.raises(ValueError, match="query dtype"):
        impl.attend(p.query.double(), p.kv_cache, md)


def test_make_impl_serves_each_layer_kind() -> None:
    assert isinstance(CpuAmxBackend.make_impl(mla_layer(4)), CpuAmxMLAImpl)
    assert isinstance(CpuAmxBackend.make_impl(mha_layer(9, 3, 64)), CpuAmxMHAImpl)


def test_weights_must_be_loaded_before_forward(decode_case) -> None:
    impl, p, md = decode_case
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        impl.absorb_query(torch.randn(2, 4, 48))
