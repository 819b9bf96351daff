"""cpu_amx attend against an independent float64 reference, on both compute paths."""

from __future__ import annotations

import pytest
import torch
from jackfield.contracts.attention import AttentionOutput
from jackfield.testing.problems import mla_layer
from jackfield_cpu_amx import kernels
from jackfield_cpu_amx.backend import CpuAmxBackend, CpuAmxMLAImpl
from jackfield_cpu_amx.plan import CpuAmxMetadataBuilder
from jackfield_cpu_amx.testing import Problem, make_problem, reference_attend

# (path, dtype, atol on out, atol on lse): float32 requests are exact to float32 rounding on
# either path (the AMX path computes them in float32); bfloat16 on the AMX path rounds scores and
# probabilities to bfloat16 before the products, as AMX does.
PATHS = [
    ("avx512_fp32", torch.float32, 2e-5, 2e-5),
    ("avx512_fp32", torch.bfloat16, 2e-2, 2e-5),
    ("amx_bf16", torch.float32, 2e-5, 2e-5),
    ("amx_bf16", torch.bfloat16, 3e-2, 3e-2),
]


def run_attend(
    path: str, problem: Problem, group_keys: int | None = None, chunk_keys: int | None = None
) -> AttentionOutput:
    builder = (
        CpuAmxBackend.metadata_builder()
        if group_keys is None
        else CpuAmxMetadataBuilder(group_keys, chunk_keys)
    )
    impl = CpuAmxMLAImpl(problem.layer, path=path)
    return impl.attend(problem.query, problem.kv_cache, builder.build(problem.metadata), return_lse=True)


@pytest.mark.parametrize("num_heads,chunk_keys", [(8, 8), (8, None), (64, None)])
@pytest.mark.parametrize("path,dtype,atol,lse_atol", PATHS)
@pytest.mark.parametrize(
    "q_lens,seq_lens,block_size,causal",
    [
        ([1, 1, 1, 1], [37, 5, 64, 1], 16, True),  # ragged decode, a one-token context
        ([1, 1], [32, 32], 8, True),  # every key visible: no mask
        ([2, 2, 3, 4], [9, 40, 17, 33], 8, True),  # multi-token (speculative) decode
        ([1, 1, 5, 12], [20, 31, 5, 50], 5, True),  # decodes then prefills, odd block size
        ([3, 3, 6], [10, 7, 6], 4, False),  # non-causal
    ],
)
def test_attend_matches_float64(
    path, dtype, atol, lse_atol, q_lens, seq_lens, block_size, causal, num_heads, chunk_keys
) -> None:
    """8 heads: the fused kernel up to 4 query rows per request (in chunks of a block or two,
    where early causal rows see no key in later chunks, or chunks by thread count), bmm beyond;
    64 heads: bmm throughout."""
    problem = make_problem(
        mla_layer(num_heads=num_heads), q_lens, seq_lens, block_size, dtype, causal=causal, seed=len(q_lens)
    )
    result = run_attend(path, problem, group_keys=16384, chunk_keys=chunk_keys)
    ref_out, ref_lse = reference_attend(problem)
    assert result.out.dtype == dtype and result.out.shape == ref_out.shape
    assert not result.out.isnan().any() and not result.lse.isnan().any()  # every row written
    torch.testing.assert_close(result.out.double(), ref_out, atol=atol, rtol=atol)
    torch.testing.assert_close(result.lse.double(), ref_lse, atol=lse_atol, rtol=0)


@pytest.mark.parametrize("chunk_keys", [1, 8, 1 << 20])
@pytest.mark.parametrize("group_keys", [1, 40, 1 << 20])
def test_grouping_and_chunking_do_not_change_results(group_keys: int, chunk_keys: int) -> None:
    """One request per group, a few per group, all in one group; one block per chunk (padded,
    some chunks past a request's end), two, all keys in one chunk: the float64 answer each time."""
    problem = make_problem(mla_layer(num_heads=4), [1] * 6, [12, 30, 7, 19, 25, 3], 4, torch.float32, seed=3)
    result = run_attend("avx512_fp32", problem, group_keys=group_keys, chunk_keys=chunk_keys)
    ref_out, ref_lse = reference_attend(problem)
    torch.testing.assert_close(result.out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(result.lse.double(), ref_lse, atol=2e-5, rtol=0)


def test_bf16_path_error_at_benchmark_width() -> None:
    """kv_lora_rank 512 / rope 64, H=16, S=1024: bf16 rounding stays within bf16 tolerance."""
    layer = mla_layer(
        num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    problem = make_problem(layer, [1, 1], [1024, 700], 64, torch.bfloat16, seed=7)
    result = run_attend("amx_bf16", problem)
    ref_out, ref_lse = reference_attend(problem)
    torch.testing.assert_close(result.out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(result.lse.double(), ref_lse, atol=5e-2, rtol=0)


@pytest.mark.parametrize("chunk_keys", [4, 1024])
def test_never_written_slots_are_not_read(chunk_keys: int) -> None:
    """Every slot past a request's seq_len (inside its last block, in padding chunks that repeat
    its first block, in blocks nobody owns) holds NaN: the results stay finite and exact."""
    problem = make_problem(mla_layer(num_heads=4), [1, 1, 3], [3, 13, 9], 4, torch.float32, seed=9)
    owned = torch.zeros(problem.kv_cache.shape[:2], dtype=torch.bool)
    for b, seq_len in enumerate(problem.metadata.seq_lens_cpu.tolist()):
        pos = torch.arange(seq_len)
        owned[problem.metadata.block_table[b, pos // 4].long(), pos % 4] = True
    problem.kv_cache[~owned] = float("nan")
    result = run_attend("avx512_fp32", problem, group_keys=1 << 20, chunk_keys=chunk_keys)
    ref_out, ref_lse = reference_attend(problem)
    torch.testing.assert_close(result.out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(result.lse.double(), ref_lse, atol=2e-5, rtol=0)


@pytest.mark.parametrize("slice_keys", [1, 40])
def test_bmm_kernel_in_request_slices(monkeypatch: pytest.MonkeyPatch, slice_keys: int) -> None:
    """64 heads (the bmm kernel) over one group, attended one request or two at a time: the
    float64 answer, with the causal mask of multi-token rows sliced along."""
    monkeypatch.setattr(kernels, "BMM_SLICE_KEYS", slice_keys)
    problem = make_problem(mla_layer(num_heads=64), [2, 2, 2], [17, 9, 20], 4, torch.float32, seed=5)
    result = run_attend("avx512_fp32", problem, group_keys=1 << 20)
    ref_out, ref_lse = reference_attend(problem)
    torch.testing.assert_close(result.out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(result.lse.double(), ref_lse, atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_heads", [16, 64])  # the fused kernel's rows, then past them
def test_bf16_amx_path_stays_accurate_at_large_logits(num_heads: int) -> None:
    """Queries scaled so the logits reach tens (as trained models' do): bfloat16 scores would be
    off by up to an ulp of 0.125 there, so the AMX path must keep scores in float32 (the fused
    kernel) for every row count, within bfloat16 output rounding of the float64 reference."""
    problem = make_problem(
        mla_layer(num_heads=num_heads), [1, 1, 2], [70, 33, 48], 16, torch.bfloat16, seed=9
    )
    problem.query.mul_(8)
    result = run_attend("amx_bf16", problem)
    ref_out, ref_lse = reference_attend(problem)
    assert (result.lse.double() - ref_lse).abs().max() < 2e-2
    assert (result.out.double() - ref_out).abs().max() < 3e-2 * ref_out.abs().max()
