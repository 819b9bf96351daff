"""Paged attention kernels vs the float64 formula (jackfield.ops.reference.paged_attention).

Small shapes: on the CPU they run in Triton's interpreter (fp16 queries). Caches are NaN-poisoned
outside the slots the metadata owns and outputs are poisoned before each run, so a read of a stray
slot or a row left unwritten shows up. Every test draws its inputs from the printed test seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.contracts.attention import AttentionMetadata
from jackfield.ops.reference import paged_attention as reference_attention
from jackfield.testing import checks
from jackfield.testing.problems import make_batch, mha_layer, poisoned_cache
from jackfield_cuda_attn.backend import CudaAttnBackend, decode_part
from jackfield_cuda_attn.kernels import paged_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16  # the interpreter mishandles bf16 tl.dot; the GPU tests cover bf16
HEADS, HEAD_SIZE = 8, 32
FP8_SCALES = (0.02, 0.03)  # key scale, value scale: distinct, so swapping them fails


@dataclass(frozen=True)
class Problem:
    query: torch.Tensor
    cache: torch.Tensor
    metadata: AttentionMetadata
    kv_scale: torch.Tensor | None
    scale: float


def make_problem(
    gen: torch.Generator,
    q_lens: list[int],
    seq_lens: list[int],
    *,
    kv_heads: int = 2,
    num_decodes: int | None = None,
    block_size: int = 16,
    causal: bool = True,
    fp8: bool = False,
    q_scale: float = 1.0,
) -> Problem:
    """Requests with random KV in every owned slot (written by torch_ref), NaN in all others."""
    nd = len(q_lens) if num_decodes is None else num_decodes
    batch = make_batch(q_lens, seq_lens, nd, block_size, DEV, gen, causal=causal)
    layer = mha_layer(HEADS, kv_heads, HEAD_SIZE, "fp8_e4m3" if fp8 else "auto")
    cache = poisoned_cache(layer, batch, DTYPE, DEV)
    slots = torch.cat([batch.context_slots, batch.metadata.slot_mapping])
    key, value = (torch.randn(slots.numel(), kv_heads, HEAD_SIZE, generator=gen).to(DEV, DTYPE) for _ in "kv")
    kv_scale = torch.tensor(FP8_SCALES, device=DEV) if fp8 else None
    TorchRefBackend.make_impl(layer).write_kv(cache, slots, key, value, kv_scale)
    query = (torch.randn(batch.num_tokens, HEADS, HEAD_SIZE, generator=gen) * q_scale).to(DEV, DTYPE)
    return Problem(query, cache, batch.metadata, kv_scale, layer.scale)


def poison_outputs(problem: Problem) -> None:
    """Freed memory of the outputs' sizes full of NaN, so a row the kernel never writes reads NaN
    (the CPU allocator hands a freed block of the same size back)."""
    checks.poison_allocator(DEV)
    tokens = problem.query.shape[0]
    for shape, dtype in (((tokens, HEADS, HEAD_SIZE), DTYPE), ((tokens, HEADS), torch.float32)):
        torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def run(
    problem: Problem,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    md = problem.metadata
    decode_reqs, decode_rows, decode_query_len = decode_part(md)
    poison_outputs(problem)
    return paged_attention(
        problem.query, problem.cache, md.block_table, md.seq_lens, md.query_start_loc,
        decode_reqs=decode_reqs, decode_rows=decode_rows, decode_query_len=decode_query_len,
        max_seq_len=md.max_seq_len, sm_scale=problem.scale, causal=md.causal, sliding_window=window,
        kv_scale=problem.kv_scale, sinks=sinks, num_splits=splits,
    )  # fmt: skip


def expected(
    problem: Problem, *, window: int | None = None, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    md = problem.metadata
    return reference_attention(
        problem.query.double(), problem.cache[0], problem.cache[1], md.block_table, md.seq_lens,
        md.query_start_loc, problem.scale, causal=md.causal, sliding_window=window,
        sinks=None if sinks is None else sinks.double(), kv_scale=problem.kv_scale,
    )  # fmt: skip


def assert_matches(problem: Problem, what: str, tol: float = 1e-2, **features) -> None:
    out, lse = run(problem, **features)
    want_out, want_lse = expected(problem, window=features.get("window"), sinks=features.get("sinks"))
    checks.assert_output_close(out, want_out.to(DTYPE), tol, what)
    checks.assert_lse_close(lse, want_lse.float(), 1e-3, what)


def random_sinks(gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(HEADS, generator=gen) * 2).to(DEV)


# ---- decode (split-KV) ----------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_across_group_ratios_and_splits(kv_heads: int, splits: int, rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 1, 1, 1], [1, 70, 33, 129], kv_heads=kv_heads)
    assert_matches(problem, f"decode, H_kv={kv_heads}, splits={splits}", splits=splits)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
@pytest.mark.parametrize("splits", [1, 4])
def test_multi_token_decode(causal: bool, splits: int, rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [8, 2, 5, 3], [8, 40, 97, 150], kv_heads=1, causal=causal)
    assert_matches(problem, f"multi-token decode, causal={causal}, splits={splits}", splits=splits)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_window_edges_across_splits(window: int, rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 4, 1, 8], [3, 90, 140, 100], kv_heads=2)
    for splits in (1, 4):
        assert_matches(problem, f"decode, window={window}, splits={splits}", window=window, splits=splits)


def test_decode_sinks_split_and_not(rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 3, 1], [50, 77, 2], kv_heads=2)
    sinks = random_sinks(gen)
    for splits in (1, 5):
        assert_matches(problem, f"decode with sinks, splits={splits}", sinks=sinks, splits=splits)


def test_decode_merge_of_large_logits(rng_seed: int) -> None:
    """Scores near 100: a merge (or online softmax) that does not subtract the maximum overflows."""
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 2], [150, 200], kv_heads=2, q_scale=25.0)
    assert_matches(problem, "decode with large logits, 4 splits", splits=4)


def test_padded_rows_of_seq_len_0_give_zero(rng_seed: int) -> None:
    """A CUDA graph's padding: seq_len 0, one query row, block table row pointing anywhere."""
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 1, 1], [20, 1, 45], kv_heads=2)
    md = problem.metadata
    seq_lens = md.seq_lens.clone()
    seq_lens[1] = 0
    padded = Problem(problem.query, problem.cache, md.replace(seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu()),
                     problem.kv_scale, problem.scale)  # fmt: skip
    for splits in (1, 3):
        out, lse = run(padded, splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1])), f"splits={splits}: padded row is not 0"
        assert bool((lse[1] == float("-inf")).all()), f"splits={splits}: padded row's LSE is not -inf"
        want_out, want_lse = expected(padded)
        checks.assert_output_close(out, want_out.to(DTYPE), 1e-2, f"padded decode, splits={splits}")
        checks.assert_lse_close(lse, want_lse.float(), 1e-3, f"padded decode, splits={splits}")


def test_fp8_cache_is_dequantized(rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 3, 20], [40, 70, 60], num_decodes=2, kv_heads=2, fp8=True)
    assert_matches(problem, "fp8 decode + prefill", splits=2)


# ---- prefill and mixed steps --------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
def test_prefill_ragged(kv_heads: int, causal: bool, rng_seed: int) -> None:
    """Query blocks of 128 rows x heads: MHA's first request spans two blocks, one chunked."""
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [150, 9, 1, 33], [150, 75, 17, 100], num_decodes=0, kv_heads=kv_heads,
                           causal=causal)  # fmt: skip
    assert_matches(problem, f"prefill, H_kv={kv_heads}, causal={causal}")


@pytest.mark.parametrize("window", [1, 16, 50])
def test_prefill_window_skips_and_masks_edges(window: int, rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [140, 30], [200, 30], num_decodes=0, kv_heads=8)
    assert_matches(problem, f"prefill, window={window}", window=window)


def test_prefill_sinks_and_large_logits(rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [40, 70], [100, 70], num_decodes=0, kv_heads=2, q_scale=25.0)
    assert_matches(problem, "prefill with sinks, large logits", sinks=random_sinks(gen))


def test_mixed_step_takes_both_kernels(rng_seed: int) -> None:
    """Two decodes (one multi-token) and two prefills in one call: the decode kernel serves the
    leading decodes, the prefill kernel the rest, into one output."""
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 4, 30, 12], [64, 90, 30, 50], num_decodes=2, kv_heads=2)
    assert decode_part(problem.metadata) == (2, 5, 4)
    assert_matches(problem, "mixed step", sinks=random_sinks(gen), window=20)


def test_impl_attend_and_forward(rng_seed: int) -> None:
    """Through the backend's impl: write_kv then attend, LSE only when asked for."""
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 12], [30, 12], num_decodes=1, kv_heads=2)
    impl = CudaAttnBackend.make_impl(mha_layer(HEADS, 2, HEAD_SIZE))
    result = impl.attend(problem.query, problem.cache, problem.metadata)
    assert result.lse is None
    want, _ = expected(problem)
    checks.assert_output_close(result.out, want.to(DTYPE), 1e-2, "impl.attend")


# ---- entry checks -------------------------------------------------------------------------------
def test_bad_inputs_are_named(rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    problem = make_problem(gen, [1, 2], [5, 20], kv_heads=2)
    md = problem.metadata
    bad = {
        "float32 query": dict(query=problem.query.float()),
        "bf16 cache with fp16 query": dict(cache=problem.cache.to(torch.bfloat16)),
        "int64 seq_lens": dict(seq_lens=md.seq_lens.long()),
        "too many query heads for the cache": dict(query=problem.query[:, :7]),
    }
    messages = {
        "float32 query": "query dtype",
        "bf16 cache with fp16 query": "16-bit cache in the query's format",
        "int64 seq_lens": "seq_lens must be int32",
        "too many query heads for the cache": "multiple of 2 KV heads",
    }
    for name, change in bad.items():
        args = dict(query=problem.query, cache=problem.cache, seq_lens=md.seq_lens) | change
        with pytest.raises(ValueError, match=messages[name]):
            paged_attention(
                args["query"], args["cache"], md.block_table, args["seq_lens"], md.query_start_loc,
                decode_reqs=2, decode_rows=3, decode_query_len=2, max_seq_len=20, sm_scale=0.1,
            )  # fmt: skip
    fp8 = problem.cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs kv_scale"):
        paged_attention(problem.query, fp8, md.block_table, md.seq_lens, md.query_start_loc,
                        decode_reqs=2, decode_rows=3, decode_query_len=2, max_seq_len=20, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"kv_scale must hold two per-tensor values \(key, value\)"):
        paged_attention(problem.query, fp8, md.block_table, md.seq_lens, md.query_start_loc,
                        decode_reqs=2, decode_rows=3, decode_query_len=2, max_seq_len=20, sm_scale=0.1,
                        kv_scale=torch.tensor([0.02], device=DEV))  # one scale: MLA's form, not MHA's
