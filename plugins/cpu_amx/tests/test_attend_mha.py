"""cpu_amx standard attention (MHA/GQA/MQA) against the float64 oracle, on both compute paths:
ragged batches of decodes and prefills with a prefix, sliding windows, sinks, multi-token decode
(causal and not), requests without rows or keys, split keys and small request groups."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from jackfield.contracts.attention import AttentionOutput
from jackfield.testing.problems import mha_layer
from jackfield_cpu_amx.backend import CpuAmxBackend, CpuAmxMHAImpl
from jackfield_cpu_amx.plan import PLANS_KEY, CpuAmxMetadataBuilder, plan_key
from jackfield_cpu_amx.testing import Problem, make_problem, reference_attend

# (path, dtype, atol on out, atol on lse): float32 requests are float32 on either path; bfloat16
# ones on the AMX path round probabilities to bfloat16 before the value product.
PATHS = [
    ("avx512_fp32", torch.float32, 2e-5, 2e-5),
    ("avx512_fp32", torch.bfloat16, 2e-2, 2e-5),
    ("amx_bf16", torch.float32, 2e-5, 2e-5),
    ("amx_bf16", torch.bfloat16, 3e-2, 3e-2),
]
# (query heads, KV heads, head size): GQA ratios 1, 3 (SmolLM2's 9/3 at D 64) and 9 (MQA).
SHAPES = [(4, 4, 32), (9, 3, 64), (9, 1, 16)]
BATCHES = {  # name: (q_lens, seq_lens, num_decodes, block_size, causal)
    "decodes+prefills with and without a prefix": ([1, 1, 5, 12, 7], [20, 31, 5, 50, 7], 2, 4, True),
    "fresh prefills (the kernel's causal mask)": ([9, 9, 9], [9, 9, 9], 0, 4, True),
    "multi-token decode": ([2, 2, 3, 4], [9, 40, 17, 33], 4, 8, True),
    "multi-token decode, non-causal": ([3, 3, 6], [10, 7, 6], 3, 4, False),
    "requests without rows or keys": ([1, 0, 1, 0, 4], [7, 0, 12, 5, 4], 3, 5, True),
    # decode-only steps take the record gather (plan.DecodeRows): ragged (padded, masked) and not
    "decodes only, ragged": ([1, 1, 1, 1], [20, 31, 5, 64], 4, 4, True),
    "decodes only, one length, non-causal": ([1, 1, 1], [16, 16, 16], 3, 8, False),
}
# (sliding window, sinks): a window of one token (each row sees itself), windows inside a block
# and across several, with and without sinks.
FEATURES = [(None, False), (None, True), (1, False), (3, True), (13, False), (13, True)]


@pytest.fixture
def nan_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every float tensor torch.empty / new_empty allocates starts as NaN (outputs, gather
    buffers): a row or key the kernels never write shows up as NaN."""
    empty, new_empty = torch.empty, torch.Tensor.new_empty

    def poisoned(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.fill_(-1)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poisoned(new_empty(self, *a, **k)))
    yield


def run_attend(
    path: str, problem: Problem, sinks: torch.Tensor | None, builder: CpuAmxMetadataBuilder | None = None
) -> AttentionOutput:
    metadata = (builder or CpuAmxBackend.metadata_builder()).build(problem.metadata)
    impl = CpuAmxMHAImpl(problem.layer, path=path)
    return impl.attend(problem.query, problem.kv_cache, metadata, sinks=sinks, return_lse=True)


def assert_matches_float64(result: AttentionOutput, problem: Problem, sinks: torch.Tensor | None,
                           atol: float, lse_atol: float) -> None:
    want_out, want_lse = reference_attend(problem, sinks)
    assert result.out.dtype == problem.query.dtype and result.out.shape == want_out.shape
    assert result.lse is not None and not result.out.isnan().any() and not result.lse.isnan().any()
    torch.testing.assert_close(result.out.double(), want_out, atol=atol, rtol=atol)
    torch.testing.assert_close(result.lse.double(), want_lse, atol=lse_atol, rtol=0)


@pytest.mark.parametrize("window,with_sinks", FEATURES)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", SHAPES)
@pytest.mark.parametrize("path,dtype,atol,lse_atol", PATHS)
def test_attend_matches_float64(
    nan_allocations, rng_seed, path, dtype, atol, lse_atol, num_heads, num_kv_heads, head_size, batch,
    window, with_sinks,
) -> None:
    q_lens, seq_lens, num_decodes, block_size, causal = BATCHES[batch]
    layer = mha_layer(num_heads, num_kv_heads, head_size, sliding_window=window)
    problem = make_problem(
        layer, q_lens, seq_lens, block_size, dtype, num_decodes=num_decodes, causal=causal, seed=rng_seed
    )
    gen = torch.Generator().manual_seed(rng_seed)
    sinks = torch.randn(num_heads, generator=gen) * 2 if with_sinks else None
    assert_matches_float64(run_attend(path, problem, sinks), problem, sinks, atol, lse_atol)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("chunk_keys", [1, 8, 1 << 20])
@pytest.mark.parametrize("group_keys", [1, 40, 1 << 20])
def test_grouping_and_chunking_do_not_change_results(
    nan_allocations, rng_seed, group_keys: int, chunk_keys: int, window: int | None
) -> None:
    """One request per group, a few, all in one; one block per key chunk (chunks that a causal
    row or a window leaves blind), two, all keys in one chunk: the float64 answer each time."""
    layer = mha_layer(6, 2, 32, sliding_window=window)
    q_lens, seq_lens = [1, 1, 2, 1, 3, 1], [12, 30, 7, 19, 25, 3]
    problem = make_problem(layer, q_lens, seq_lens, 4, torch.float32, num_decodes=6, seed=rng_seed)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(rng_seed))
    builder = CpuAmxMetadataBuilder(group_keys, chunk_keys)
    assert_matches_float64(run_attend("avx512_fp32", problem, sinks, builder), problem, sinks, 2e-5, 2e-5)


def test_a_window_gathers_only_the_blocks_it_reaches(rng_seed) -> None:
    """A decode at position 99 with a window of 10 sees keys 90..99: blocks 11 and 12 of 8."""
    layer = mha_layer(4, 2, 32, sliding_window=10)
    problem = make_problem(layer, [1, 1], [100, 30], 8, torch.float32, num_decodes=2, seed=rng_seed)
    md = CpuAmxBackend.metadata_builder().build(problem.metadata)
    (group,) = md.extra[PLANS_KEY][plan_key(md)].groups
    chunks = group.key_chunks(8, split=False, sliding_window=10)
    table = problem.metadata.block_table.long()
    assert chunks.blocks_per_req == 2
    assert chunks.block_ids.tolist() == [*table[0, 11:13].tolist(), *table[1, 2:4].tolist()]


@pytest.mark.parametrize("window", [None, 10])
def test_decode_rows_read_only_written_records(rng_seed, window: int | None) -> None:
    """A decode-only step gathers each request's visible keys record by record: positions
    [seq_len - window, seq_len) (or from 0), padded with repeats of the first, which alone are
    masked; the rows index the [2 * blocks * block_size, H_kv * D] view, keys then values."""
    layer = mha_layer(4, 2, 32, sliding_window=window)
    seq_lens, block_size = [100, 30, 7], 8
    problem = make_problem(layer, [1, 1, 1], seq_lens, block_size, torch.float32, num_decodes=3,
                           seed=rng_seed)
    md = CpuAmxBackend.metadata_builder().build(problem.metadata)
    (group,) = md.extra[PLANS_KEY][plan_key(md)].groups
    num_blocks = problem.kv_cache.shape[1]
    rows = group.decode_rows(block_size, num_blocks, window)
    table = problem.metadata.block_table.long()
    firsts = [max(0, n - window) if window else 0 for n in seq_lens]
    counts = [n - f for n, f in zip(seq_lens, firsts, strict=True)]
    assert rows.num_keys == max(counts)
    want = []
    for b, (first, count) in enumerate(zip(firsts, counts, strict=True)):
        positions = torch.tensor([*range(first, first + count), *[first] * (rows.num_keys - count)])
        want.append(table[b, positions // block_size] * block_size + positions % block_size)
    slots = torch.cat(want)
    assert rows.row_ids.tolist() == [*slots.tolist(), *(slots + num_blocks * block_size).tolist()]
    records = problem.kv_cache.view(2 * num_blocks * block_size, -1)[rows.row_ids]
    assert not records.isnan().any()  # never-written slots hold NaN in this cache
    hidden = torch.tensor([[k >= c for k in range(rows.num_keys)] for c in counts])
    if hidden.any():
        assert rows.mask is not None
        assert rows.mask.view(3, -1).eq(float("-inf")).equal(hidden)
        assert rows.mask.view(3, -1)[~hidden].eq(0).all()
    else:
        assert rows.mask is None


def test_long_prefills_are_grouped_within_the_mask_budget() -> None:
    """Masks are num_reqs x q_len x keys: prompts of 2048 go one per group."""
    problem = make_problem(mha_layer(4, 2, 32), [2048, 2048], [2048, 2048], 64, torch.float32)
    md = CpuAmxBackend.metadata_builder().build(problem.metadata)
    assert [g.num_reqs for g in md.extra[PLANS_KEY][plan_key(md)].groups] == [1, 1]
