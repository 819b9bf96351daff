"""Decode context parallel's arithmetic in one process: the LSE merge against float64 attention,
the KV placement, sharded loading, and the capability gate."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from jackfield.config import load_config
from jackfield.distributed.dcp import (
    DCPLayout,
    merge_partials,
    neutralize_empty_sparse_rows,
    partial_weights,
    sanitize_lse,
)
from jackfield.distributed.tensor_parallel import part
from jackfield.models.weights import Rule, ShardPlan, Split, WeightMapper, load_weights
from jackfield.ops.merge import merge_attn_states
from jackfield.plugins import Registered, load_registry
from jackfield.preflight import preflight
from jackfield.specs import AttentionBackendSpec
from jackfield.testing.checkpoints import write_deepseek_v32, write_granite
from safetensors import safe_open
from safetensors.torch import save_file

SEED = 2121
SHAPES = [(4, 64, 512), (1, 8, 64), (42, 28, 320), (1111, 28, 576), (1024, 128, 512)]  # (T, H, D)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
              dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, D], lse [T, H] of q [T, H, D] over k, v [S, D] (one shared KV head), keys
    masked by visible [T, S], all in `dtype`: out 0 and lse -inf where nothing is visible."""
    t, h, d = q.shape
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = (q.reshape(t * h, d) @ k.T).view(t, h, -1) / math.sqrt(d)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.where(visible[:, None, :], torch.exp(scores - lse.nan_to_num(neginf=0)[..., None]), 0.0)
    return (probs.reshape(t * h, -1) @ v).view(t, h, -1), lse


@pytest.mark.parametrize(("shape", "ranks"), [(s, 4) for s in SHAPES] + [(s, 2) for s in SHAPES[:3]])
def test_merge_of_rank_partials_is_float64_attention(shape: tuple[int, int, int], ranks: int) -> None:
    """Keys interleaved over the ranks; each rank's partial in float32 (one rank sees nothing
    for some rows); the merge equals attention over every key in float64."""
    print(f"seed {SEED}")
    t, h, d = shape
    gen = torch.Generator().manual_seed(SEED + t + ranks)
    num_keys = 3 * ranks + 1
    q, k, v = (torch.randn(n, *rest, generator=gen) for n, *rest in ((t, h, d), (num_keys, d), (num_keys, d)))
    # each row sees a random prefix of the keys, some fewer than the ranks (empty ranks)
    lengths = torch.randint(1, num_keys + 1, (t,), generator=gen)
    lengths[: min(t, ranks)] = torch.arange(1, min(t, ranks) + 1)
    positions = torch.arange(num_keys)
    visible = positions[None, :] < lengths[:, None]
    want, want_lse = attention(q, k, v, visible)
    layout_owner = DCPLayout(0, ranks).owner(positions)
    outs, lses = [], []
    for rank in range(ranks):
        mine = visible & (layout_owner == rank)[None, :]
        out, lse = attention(q, k, v, mine, torch.float32)
        outs.append(out)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged.double(), want, atol=2e-6, rtol=2e-5)
    # the weights of the ranks sum to one (the merged LSE is the float64 one)
    every = sanitize_lse(torch.stack(lses))
    total = sum(partial_weights(every[r], every).double() for r in range(ranks))
    torch.testing.assert_close(total, torch.ones_like(want_lse), atol=1e-5, rtol=0)


def test_merge_is_the_pairwise_merge_folded() -> None:
    """Two ranks: the same as ops.merge_attn_states; four: the pairwise merge folded over ranks."""
    gen = torch.Generator().manual_seed(SEED)
    outs = torch.randn(4, 42, 28, 320, generator=gen)
    lses = torch.randn(4, 42, 28, generator=gen) * 3
    lses[1, :5] = float("-inf")  # an empty rank for some rows
    folded, folded_lse = outs[0], lses[0]
    for r in range(1, 4):
        folded, folded_lse = merge_attn_states(folded, folded_lse, outs[r], lses[r])
        if r == 1:
            torch.testing.assert_close(merge_partials(outs[:2], lses[:2]), folded, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merge_partials(outs, lses), folded, atol=1e-6, rtol=1e-5)


def test_empty_and_broken_ranks_contribute_exact_zero() -> None:
    """A rank with no key (lse -inf), or whose kernel gave NaN or +inf, adds nothing, whatever
    its output holds (NaN included); rows empty everywhere are exactly 0."""
    gen = torch.Generator().manual_seed(SEED + 1)
    outs = torch.randn(3, 6, 4, 16, generator=gen)
    lses = torch.randn(3, 6, 4, generator=gen)
    alone = merge_partials(outs[:1], lses[:1])
    for broken in (float("-inf"), float("nan"), float("inf")):
        poisoned_out, poisoned_lse = outs.clone(), lses.clone()
        poisoned_out[1:] = float("nan")
        poisoned_lse[1:] = broken
        assert torch.equal(merge_partials(poisoned_out, poisoned_lse), alone)
    nothing = merge_partials(torch.full_like(outs, float("nan")), torch.full_like(lses, float("-inf")))
    assert torch.equal(nothing, torch.zeros_like(nothing))


def test_sparse_rows_with_nothing_selected_are_neutralized() -> None:
    gen = torch.Generator().manual_seed(SEED + 2)
    out, lse = torch.randn(5, 4, 8, generator=gen), torch.randn(5, 4, generator=gen)
    topk = torch.randint(0, 9, (5, 6), generator=gen, dtype=torch.int32)
    topk[[1, 3]] = -1
    out[1], lse[1] = float("nan"), float("nan")  # a kernel's answer for a row with no key
    clean_out, clean_lse = neutralize_empty_sparse_rows(out, lse, topk)
    assert torch.equal(clean_out[[1, 3]], torch.zeros(2, 4, 8))
    assert (clean_lse[[1, 3]] == float("-inf")).all()
    keep = [0, 2, 4]
    assert torch.equal(clean_out[keep], out[keep]) and torch.equal(clean_lse[keep], lse[keep])


@pytest.mark.parametrize(("ranks", "interleave", "block_size"), [(2, 1, 4), (4, 2, 4), (3, 4, 8)])
def test_placement_is_a_bijection_and_each_rank_holds_one_dcp_th(ranks: int, interleave: int,
                                                                  block_size: int) -> None:
    positions = torch.arange(5 * ranks * block_size + 3)
    layouts = [DCPLayout(r, ranks, interleave) for r in range(ranks)]
    owner, offset = layouts[0].owner(positions), layouts[0].local_offset(positions)
    assert torch.equal(owner, (positions // interleave) % ranks)  # the formula
    for layout in layouts:
        mine = positions[owner == layout.rank]
        # a rank's tokens fill its offsets 0, 1, 2, ... in position order
        assert torch.equal(offset[owner == layout.rank], torch.arange(mine.numel()))
        # local_len(n) counts them; block j of B * W positions is local block j of B slots
        for n in range(positions.numel() + 1):
            assert int(layout.local_len(torch.tensor(n))) == int((mine < n).sum())
        assert torch.equal(offset[owner == layout.rank] // block_size, mine // (block_size * ranks))
        # blocks per rank = 1/dcp of the request's blocks at block_size
        held = int(layout.local_len(torch.tensor(positions.numel())))
        assert -(-held // block_size) <= -(-positions.numel() // (block_size * ranks))


def test_part_covers_a_dimension_once() -> None:
    for size, parts in ((97, 2), (97, 4), (256, 8), (3, 4)):
        ranges = [part(size, i, parts) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_a_rank_reads_only_its_shard(tmp_path: Path) -> None:
    """Column, row and fused (gate ‖ up in one tensor) splits and whole experts, read through
    safetensors slices, against slicing the full tensors by hand."""
    gen = torch.Generator().manual_seed(SEED + 3)
    full = {"w.col": torch.randn(8, 6, generator=gen), "w.row": torch.randn(6, 8, generator=gen),
            "w.fused": torch.randn(8, 6, generator=gen),
            **{f"e.{i}": torch.randn(3, 2, generator=gen) for i in range(4)}}
    save_file(full, str(tmp_path / "model.safetensors"))
    mapper = WeightMapper((Rule(r"e\.(?P<i>\d+)", "experts", expert="i"), Rule(r"(?P<n>.+)", "{n}")))
    for rank in range(2):
        plan = ShardPlan(splits=((r"w\.col", Split(0, rank, 2)), (r"w\.row", Split(1, rank, 2)),
                                 (r"w\.fused", Split(0, rank, 2, fused=2))), experts=(2 * rank, 2))
        params = {"w.col": torch.empty(4, 6), "w.row": torch.empty(6, 4), "w.fused": torch.empty(4, 6),
                  "experts": torch.empty(2, 3, 2)}
        with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
            load_weights(params, ((name, f.get_slice(name)) for name in f.keys()), mapper, plan)  # noqa: SIM118
        assert torch.equal(params["w.col"], full["w.col"][4 * rank : 4 * rank + 4])
        assert torch.equal(params["w.row"], full["w.row"][:, 4 * rank : 4 * rank + 4])
        gate, up = full["w.fused"].chunk(2)
        mine = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(params["w.fused"], torch.cat((gate[mine], up[mine])))
        assert torch.equal(params["experts"], torch.stack([full[f"e.{2 * rank + i}"] for i in range(2)]))


def test_a_backend_without_dcp_is_refused_with_those_that_have_it() -> None:
    from jackfield.builtins import TORCH_REF_CAPABILITIES

    registry = load_registry(entry_points=[])
    no_dcp = AttentionBackendSpec(name="no_lse", factory="jackfield.attention.torch_ref:TorchRefBackend",
                                  capabilities=dataclasses.replace(TORCH_REF_CAPABILITIES, dcp=False))
    registry.entries["attention"]["no_lse"] = Registered("attention", no_dcp, "test", "test-dist")
    config = load_config(None, {"parallel.tensor_parallel_size": 2, "parallel.dcp_size": 2,
                                "attention.backend": "no_lse"})
    problems = preflight(config, registry).problems
    refusal = [p for p in problems if "does not declare dcp" in p]
    assert len(refusal) == 2 and all("installed backends that do: torch_ref" in p for p in refusal), problems
    # with dcp_size 1 nothing is said about dcp
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, dcp_size=1))
    assert not any("dcp" in p for p in preflight(config, registry).problems)


def test_combinations_not_verified_are_refused_at_start_up(tmp_path: Path) -> None:
    write_granite("granite_swa", tmp_path / "swa", seed=SEED)
    write_deepseek_v32(tmp_path / "v32", index_topk=4, seed=SEED)
    cases = {"swa": "sliding-window layers under decode context parallel are not verified",
             "v32": "sparse attention (DeepSeek-V3.2's indexer reads every key) under decode context"}
    for model, message in cases.items():
        config = load_config(None, {"model.path": str(tmp_path / model), "parallel.tensor_parallel_size": 2,
                                    "parallel.dcp_size": 2})
        assert any(message in p for p in preflight(config).problems), preflight(config).problems
    speculative = load_config(None, {"parallel.tensor_parallel_size": 2, "speculative.method": "ngram",
                                     "speculative.num_speculative_tokens": 2})
    assert any("speculative decoding under tensor parallelism" in p for p in preflight(speculative).problems)


def test_serve_refuses_tensor_parallel_before_loading(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from jackfield.cli import main

    config = tmp_path / "tp.toml"
    config.write_text("[parallel]\ntensor_parallel_size = 2\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "parallel.tensor_parallel_size > 1 is not served yet" in capsys.readouterr().err
