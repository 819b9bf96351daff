"""The new families through the whole engine (scheduler, chunked prefill, prefix cache, batched
decode): greedy tokens equal transformers' for prompts longer than the window / the top-k."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import greedy_reference, write_deepseek_v32, write_granite

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14], [90, 1, 56, 23, 8, 47, 11]]  # over the window, the top-k


def assert_engine_matches_transformers(
    hf_model: torch.nn.Module, path: Path, prompts: list[list[int]], **roles: str
) -> None:
    # a small token budget: the prompts span several chunks, mixed with other requests' decodes
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, **(roles or {"backend": "torch_ref"}))
    assert llm.engine.runner.backends.split == bool(roles)
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)  # prefix-cache hits on the prompts' full blocks
    assert any(o.num_cached_tokens for o in again)
    for prompt, out, cached in zip(prompts, first, again, strict=True):
        want, _ = greedy_reference(hf_model, prompt, GREEDY.max_tokens)
        assert out.token_ids == want and cached.token_ids == want


@pytest.mark.parametrize("name", ["granite_swa", "granitemoe_swa"])
def test_granite_swa_through_the_engine(name: str, tmp_path: Path) -> None:
    hf_model = write_granite(name, tmp_path)
    assert_engine_matches_transformers(hf_model, tmp_path, PROMPTS)


def test_deepseek_v32_sparse_through_the_engine(tmp_path: Path) -> None:
    hf_model = write_deepseek_v32(tmp_path, index_topk=4)
    assert_engine_matches_transformers(hf_model, tmp_path, PROMPTS)


@pytest.mark.parametrize("name", ["granite_swa", "v32"])
def test_split_prefill_and_decode_backends(name: str, tmp_path: Path, second_ref: str) -> None:
    """Mixed steps (decodes of one request beside prefill chunks of another) with a different
    backend per role: each half goes to its role's impl with its own metadata."""
    path = tmp_path / name
    hf_model = write_deepseek_v32(path, index_topk=4) if name == "v32" else write_granite(name, path)
    assert_engine_matches_transformers(
        hf_model, path, PROMPTS, prefill_backend=second_ref, decode_backend="torch_ref"
    )
