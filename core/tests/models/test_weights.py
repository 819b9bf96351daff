"""Checkpoint loading fails closed, naming every tensor that is off (and loads the rest exactly)."""

from __future__ import annotations

import pytest
import torch
from jackfield.models.deepseek import DEEPSEEK_WEIGHTS
from jackfield.models.weights import Rule, ShardPlan, Split, WeightMapper, load_weights

MLP = "model.layers.0.mlp"
EXPERTS = "model.layers.1.mlp.experts"


def params() -> dict[str, torch.Tensor]:
    return {
        f"{MLP}.gate_up_proj.weight": torch.full((8, 3), float("nan")),
        f"{EXPERTS}.w13": torch.full((2, 8, 3), float("nan")),
        "model.norm.weight": torch.full((3,), float("nan")),
    }


def checkpoint() -> dict[str, torch.Tensor]:
    tensors = {f"{MLP}.gate_proj.weight": torch.randn(4, 3), f"{MLP}.up_proj.weight": torch.randn(4, 3),
               "model.norm.weight": torch.randn(3)}
    for e in range(2):
        tensors[f"{EXPERTS}.{e}.gate_proj.weight"] = torch.randn(4, 3)
        tensors[f"{EXPERTS}.{e}.up_proj.weight"] = torch.randn(4, 3)
    return tensors


def test_fused_and_stacked_parameters_are_assembled() -> None:
    target, source = params(), checkpoint()
    load_weights(target, iter(source.items()), DEEPSEEK_WEIGHTS)
    gate_up = target[f"{MLP}.gate_up_proj.weight"]
    assert torch.equal(gate_up,
                       torch.cat([source[f"{MLP}.gate_proj.weight"], source[f"{MLP}.up_proj.weight"]]))
    for e in range(2):
        want = torch.cat([source[f"{EXPERTS}.{e}.gate_proj.weight"], source[f"{EXPERTS}.{e}.up_proj.weight"]])
        assert torch.equal(target[f"{EXPERTS}.w13"][e], want)


def test_every_problem_is_named() -> None:
    source = checkpoint()
    del source[f"{MLP}.up_proj.weight"]  # half of a fused parameter missing
    source["model.layers.0.self_attn.mystery.weight"] = torch.randn(2)  # no home in the model
    source["model.norm.weight"] = torch.randn(4)  # wrong shape
    source[f"{EXPERTS}.7.gate_proj.weight"] = torch.randn(4, 3)  # an expert the model does not have
    with pytest.raises(ValueError) as info:
        load_weights(params(), iter(source.items()), DEEPSEEK_WEIGHTS)
    message = str(info.value)
    for fragment in ("mystery", "model.norm.weight: checkpoint (4,), model (3,)", "expert 7 of 2",
                     f"{MLP}.gate_up_proj.weight (12 of 24 elements)"):
        assert fragment in message, (fragment, message)


def test_a_piece_written_twice_is_an_error_even_when_sizes_add_up() -> None:
    """gate twice and up never would write 24 of 24 elements; the piece bookkeeping catches it."""
    source = list(checkpoint().items())
    source = ([(n, t) for n, t in source if n != f"{MLP}.up_proj.weight"]
              + [(f"{MLP}.gate_proj.weight", torch.randn(4, 3))])
    with pytest.raises(ValueError, match=r"(?s)written twice: .*gate_proj"):
        load_weights(params(), iter(source), DEEPSEEK_WEIGHTS)


def test_non_finite_weights_are_named_in_the_models_dtype() -> None:
    """A NaN in the file, and a finite float32 value beyond float16's range (inf once converted):
    both named; a finite checkpoint loads (the params start as NaN, so a skipped copy would fail)."""
    source = checkpoint()
    source[f"{EXPERTS}.1.up_proj.weight"][2, 1] = float("nan")
    source["model.norm.weight"][0] = 1e5  # float16's largest finite value is 65504
    half = {name: t.half() for name, t in params().items()}
    with pytest.raises(ValueError) as info:
        load_weights(half, iter(source.items()), DEEPSEEK_WEIGHTS)
    message = str(info.value)
    assert "NaN or infinite values in float16" in message
    assert f"{EXPERTS}.1.up_proj.weight" in message and "model.norm.weight" in message
    assert f"{MLP}.gate_proj.weight" not in message
    source[f"{EXPERTS}.1.up_proj.weight"][2, 1] = 0.5
    with pytest.raises(ValueError, match="model.norm.weight") as info:  # 1e5 is still beyond float16
        load_weights({name: t.half() for name, t in params().items()}, iter(source.items()), DEEPSEEK_WEIGHTS)
    assert "up_proj" not in str(info.value)
    load_weights(params(), iter(source.items()), DEEPSEEK_WEIGHTS)  # float32 holds 1e5


QKV = "model.layers.0.self_attn.qkv_proj.weight"
QKV_RULES = WeightMapper(tuple(
    Rule(rf"model\.layers\.0\.self_attn\.{name}_proj\.weight", QKV, shard=(i, 3), sizes=(4, 2, 2))
    for i, name in enumerate("qkv")
))  # 4 query heads, 2 KV heads


def qkv_checkpoint(head_dim: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.0.self_attn.{name}_proj.weight": torch.randn(heads * head_dim, 5)
            for name, heads in (("q", 4), ("k", 2), ("v", 2))}


def test_shards_of_unequal_sizes_fill_their_rows() -> None:
    """q, k and v of different head counts land in their own rows of one fused parameter."""
    source = qkv_checkpoint(head_dim=3)
    target = {QKV: torch.full((24, 5), float("nan"))}
    load_weights(target, iter(source.items()), QKV_RULES)
    assert torch.equal(target[QKV], torch.cat(list(source.values())))


def test_each_shard_takes_its_own_tensor_parallel_split() -> None:
    """Rank 1 of 2: the second half of the query heads, the second KV head (each its own Split)."""
    source = qkv_checkpoint(head_dim=3)
    q, k, v = source.values()
    plan = ShardPlan(splits=((QKV, (Split(0, 1, 2), Split(0, 1, 2), Split(0, 1, 2))),))
    target = {QKV: torch.full((12, 5), float("nan"))}  # 2 query heads and 1 + 1 KV heads of 3 rows
    load_weights(target, iter(source.items()), QKV_RULES, plan)
    assert torch.equal(target[QKV], torch.cat([q[6:], k[3:], v[3:]]))


def test_sizes_need_a_shard_of_as_many_parts() -> None:
    with pytest.raises(ValueError, match="sizes"):
        Rule("a", "b", shard=(0, 2), sizes=(1, 2, 3))
