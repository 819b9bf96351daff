"""The native decode kernel (native/mla_decode.c) against a float64 reference.

On any AVX-512-BF16 CPU through its emulated-tile build (the same source, the four tile
operations as C loops), on an AMX host through the AMX build too.

Tolerance, from the kernel's arithmetic: scores are float32 sums of exact bf16 x bf16 products
(relative error ~1e-6, so the LSE is held to 1e-4); the probabilities P are rounded to bf16 before
P x V (relative 2^-9 each, so at most 2^-9 * max|v| on an output), and the output is rounded to
bf16 (2^-9 relative): |out - ref| <= 2^-8 * max|v| + 2^-8 * |ref| covers both with a factor 2.
"""

from __future__ import annotations

import math

import pytest
import torch
from cpu_amx_problems import Problem, make_layer, make_problem
from jackfield_cpu_amx.capabilities import is_amx_bmm_enabled, read_cpu_flags
from jackfield_cpu_amx.native import AVX512_FLAGS, NativeKernel
from jackfield_cpu_amx.plan import PLANS_KEY, CpuAmxMetadataBuilder, RequestGroup, plan_key

MISSING_AVX512 = [flag for flag in AVX512_FLAGS if flag not in read_cpu_flags()]
needs_avx512_bf16 = pytest.mark.skipif(
    bool(MISSING_AVX512), reason=f"the kernel's AVX-512 code needs {', '.join(MISSING_AVX512)}"
)
needs_amx = pytest.mark.skipif(
    not is_amx_bmm_enabled(), reason="needs a CPU with AMX-BF16 granted by the OS (the GPU machine's Xeon)"
)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> NativeKernel:
    return NativeKernel(emulate_tiles=True, cache=tmp_path_factory.mktemp("native_cache"))


@pytest.fixture(scope="module")
def amx(tmp_path_factory: pytest.TempPathFactory) -> NativeKernel:
    return NativeKernel(emulate_tiles=False, cache=tmp_path_factory.mktemp("native_cache"))


def poison_unowned_slots(problem: Problem) -> None:
    """NaN in every cache slot no request owns (past seq_len in a last block, unused blocks)."""
    block_size = problem.kv_cache.shape[1]
    owned = torch.zeros(problem.kv_cache.shape[:2], dtype=torch.bool)
    for b, seq_len in enumerate(problem.metadata.seq_lens_cpu.tolist()):
        pos = torch.arange(seq_len)
        owned[problem.metadata.block_table[b, pos // block_size].long(), pos % block_size] = True
    problem.kv_cache[~owned] = float("nan")


def only_group(problem: Problem) -> RequestGroup:
    built = CpuAmxMetadataBuilder(group_keys=1 << 30).build(problem.metadata)
    (group,) = built.extra[PLANS_KEY][plan_key(built)].groups
    return group


def reference(problem: Problem, group: RequestGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of each query token over its first visible_keys keys (0: out 0, lse -inf)."""
    tables, lay = group.decode_tables, problem.layer
    assert tables is not None
    block_size = problem.kv_cache.shape[1]
    out = torch.zeros(problem.query.shape[0], lay.num_heads, lay.kv_lora_rank, dtype=torch.float64)
    lse = torch.full(problem.query.shape[:2], -math.inf, dtype=torch.float64)
    for t, visible in enumerate(tables.visible_keys.tolist()):
        if visible <= 0:
            continue
        r = t // tables.q_len
        pos = torch.arange(visible)
        records = problem.kv_cache[tables.block_table[r, pos // block_size].long(), pos % block_size].double()
        scores = problem.query[t].double() @ records.T * lay.scale  # [H, visible]
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ records[:, : lay.kv_lora_rank]
    return out, lse


def run_kernel(
    kernel: NativeKernel, problem: Problem, group: RequestGroup, num_threads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs poisoned with NaN first: every row must be written."""
    lay = problem.layer
    tables = group.decode_tables
    assert tables is not None
    layout = group.native_layout(problem.kv_cache.shape[1], lay.num_heads, num_threads)
    out = torch.full((problem.query.shape[0], lay.num_heads, lay.kv_lora_rank), math.nan, dtype=torch.bfloat16)
    lse = torch.full(problem.query.shape[:2], math.nan)
    kernel.decode(problem.query, problem.kv_cache, tables, layout, lay.scale, out, lse)
    return out, lse


def assert_close_to_reference(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, values: torch.Tensor
) -> None:
    assert not out.isnan().any() and not lse.isnan().any()
    blind = ref_lse == -math.inf
    assert torch.equal(lse[blind], ref_lse[blind].float()) and not out[blind].any()
    max_value = float(values.abs().max())
    torch.testing.assert_close(out.double(), ref_out, atol=2**-8 * max_value, rtol=2**-8)
    torch.testing.assert_close(lse[~blind].double(), ref_lse[~blind], atol=1e-4, rtol=0)


@needs_avx512_bf16
@pytest.mark.parametrize("kv_lora_rank,rope", [(64, 32), (48, 16)])  # 48: a last half column group
@pytest.mark.parametrize("num_heads", [16, 20])  # 20: the last 16-row group padded
@pytest.mark.parametrize("q_len,causal", [(1, True), (2, True), (4, True), (3, False)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_threads", [1, 64])  # 64: several splits per request, merged
def test_emulated_kernel_matches_float64(
    emulated: NativeKernel,
    kv_lora_rank: int,
    rope: int,
    num_heads: int,
    q_len: int,
    causal: bool,
    block_size: int,
    num_threads: int,
) -> None:
    """Ragged requests: one key, a length not a multiple of the block or the 64-key chunk,
    exactly a block, several chunks; scattered blocks, NaN in every slot nobody owns."""
    layer = make_layer(num_heads, kv_lora_rank=kv_lora_rank, rope=rope)
    seq_lens = [max(q_len, 1), 37, 2 * block_size, 150]
    problem = make_problem(layer, [q_len] * 4, seq_lens, block_size, torch.bfloat16, causal=causal, seed=q_len)
    poison_unowned_slots(problem)
    group = only_group(problem)
    out, lse = run_kernel(emulated, problem, group, num_threads)
    assert_close_to_reference(out, lse, *reference(problem, group), problem.kv_cache.nan_to_num())
