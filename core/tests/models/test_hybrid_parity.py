"""Qwen3-Next (Gated DeltaNet + gated attention + MoE) and Granite 4.0 hybrid (Mamba2 + attention)
against transformers' own models: the same random weights through a saved checkpoint, prompts
that cross several prefill chunks, batched greedy decode, scattered paged blocks and state slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield.models import model_class
from jackfield.models.hf_config import read_hf_config
from jackfield.testing.checkpoints import HYBRID_FAMILY, write_hybrid
from jackfield.testing.paged import TORCH_REF, assert_generates_like_transformers, generate

PROMPTS = [
    [5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14, 26, 51],
    [90, 1, 56, 23, 8, 47, 11],
]


def build(name: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """transformers' model of HYBRID_FAMILY[name] and Jackfield's, from one saved checkpoint."""
    path = tmp_path / name
    hf_model = write_hybrid(name, path)
    config = read_hf_config(path)
    ours = model_class(config.architectures[0]).from_pretrained(path, config, TORCH_REF, torch.float32, "cpu")
    return hf_model, ours


@pytest.mark.parametrize("name", list(HYBRID_FAMILY))
def test_logits_and_greedy_tokens_match_transformers(name: str, tmp_path: Path) -> None:
    hf_model, ours = build(name, tmp_path)
    assert ours.recurrent_state_layers and ours.kv_cache_layers
    assert_generates_like_transformers(ours, hf_model, PROMPTS, max_new=6, prefill_chunk=4)


def test_recurrent_state_is_really_carried(tmp_path: Path) -> None:
    """Dropping the carried state between prefill chunks changes the logits: the parity above
    could not pass with layers that only see their own chunk."""
    _, ours = build("qwen3_next", tmp_path)
    _, chunked = generate(ours, PROMPTS[:1], 1, prefill_chunk=4)
    _, whole = generate(ours, PROMPTS[:1], 1, prefill_chunk=64)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_next", "granitemoehybrid"])
def test_long_prompts_through_the_chunked_form_match_transformers(name: str, tmp_path: Path) -> None:
    """Prefill chunks longer than ops.recurrent.CHUNK take the chunked (matmul) form."""
    hf_model, ours = build(name, tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (120, 90)]
    assert_generates_like_transformers(ours, hf_model, prompts, max_new=3, prefill_chunk=100)
