"""DeepSeek-V3.2 (lightning indexer + sparse MLA) against transformers' DeepseekV32ForCausalLM:
index_topk above the sequence length (dense in effect) and well below it (the sparse case)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield.models.deepseek_v32 import DeepseekV32ForCausalLM
from jackfield.models.hf_config import deepseek_arch, read_hf_config
from jackfield.testing.checkpoints import DEEPSEEK_V32, write_deepseek_v32
from jackfield.testing.paged import TORCH_REF, PagedRun, assert_generates_like_transformers, generate
from transformers import DeepseekV32Config

PROMPTS = [[5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14, 6, 19], [90, 1, 56, 23, 8, 47, 11]]


def build(tmp_path: Path, index_topk: int,
          **changes: object) -> tuple[torch.nn.Module, DeepseekV32ForCausalLM]:
    """transformers' V3.2 and Jackfield's, from one saved checkpoint (`changes`: config fields)."""
    path = tmp_path / f"v32_{index_topk}"
    hf_model = write_deepseek_v32(path, index_topk, **changes)
    ours = DeepseekV32ForCausalLM.from_pretrained(path, read_hf_config(path), TORCH_REF, torch.float32, "cpu")
    return hf_model, ours


@pytest.mark.parametrize("index_topk", [64, 4], ids=["topk_above_length", "sparse_topk_4"])
def test_logits_and_greedy_tokens_match_transformers(index_topk: int, tmp_path: Path) -> None:
    hf_model, ours = build(tmp_path, index_topk)
    max_new = 5
    assert_generates_like_transformers(ours, hf_model, PROMPTS, max_new, prefill_chunk=6)


def test_mlp_layer_types_win_over_first_k_dense_replace(tmp_path: Path) -> None:
    """transformers builds V3.2's layers from mlp_layer_types when config.json has it; here it
    disagrees with first_k_dense_replace=1 (MoE first, dense second), and the logits still match."""
    hf_model, ours = build(tmp_path, 4, mlp_layer_types=["sparse", "dense"])
    hf_mlps = [type(layer.mlp).__name__ for layer in hf_model.model.layers]
    assert hf_mlps == ["DeepseekV32MoE", "DeepseekV32MLP"]
    assert deepseek_arch(read_hf_config(tmp_path / "v32_4")).mlp_layer_types == ("sparse", "dense")
    assert_generates_like_transformers(ours, hf_model, PROMPTS, 3, prefill_chunk=6)


@pytest.mark.parametrize("types", [["sparse"], ["sparse", "moe"]], ids=["too_short", "unknown_type"])
def test_malformed_mlp_layer_types_are_refused(tmp_path: Path, types: list[str]) -> None:
    import json

    config = DeepseekV32Config(**DEEPSEEK_V32, index_topk=4)
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "mlp_layer_types": types}))
    # transformers' own validator refuses it when reading config.json (older ones: deepseek_arch)
    with pytest.raises(ValueError, match=r"(?s)config\.json: .*mlp_layer_types|mlp_layer_types must list"):
        deepseek_arch(read_hf_config(tmp_path))


def test_sparse_selection_changes_the_answer(tmp_path: Path) -> None:
    """top-4 of 13 tokens is not dense attention: the sparse path really drops keys."""
    _, sparse = build(tmp_path, 4)
    _, dense = build(tmp_path, 64)
    _, sparse_logits = generate(sparse, PROMPTS[:1], 1)
    _, dense_logits = generate(dense, PROMPTS[:1], 1)
    # rows 0-3 see at most 4 keys, so they agree; every later row drops some.
    torch.testing.assert_close(sparse_logits[0][:4], dense_logits[0][:4], atol=1e-5, rtol=1e-5)
    assert (sparse_logits[0][4:] - dense_logits[0][4:]).abs().max() > 1e-3


def test_indexer_keys_live_in_their_own_paged_caches(tmp_path: Path) -> None:
    _, ours = build(tmp_path, 4)
    layers = ours.kv_cache_layers
    assert len(layers) == 4
    assert layers[0] is ours.attention_spec and layers[2].head_size == DEEPSEEK_V32["index_head_dim"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"index_topk": 0}, "must be positive"),
        ({"index_head_dim": 4}, "smaller than qk_rope_head_dim"),
        ({"is_causal": False}, "is_causal=false with the sparse indexer"),
    ],
)
def test_bad_indexer_configs_fail_closed(changes: dict[str, object], message: str) -> None:
    config = DeepseekV32Config(
        **{**DEEPSEEK_V32, "index_topk": 4, **changes}, architectures=["DeepseekV32ForCausalLM"]
    )
    with pytest.raises(ValueError, match=message):
        deepseek_arch(config)


def test_indexer_rejects_out_of_range_slots(tmp_path: Path) -> None:
    _, ours = build(tmp_path, 4)
    run = PagedRun(ours, block_size=4, num_blocks=2)
    run.add()
    run.free = [5]  # a block id past the end of the 2-block caches
    with pytest.raises(ValueError, match="holds slot 2[0-9], but the cache has 8 slots"):
        run.step([(0, [1, 2, 3])])
