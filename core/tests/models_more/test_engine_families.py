"""The new families through the whole engine (scheduler, chunked prefill, prefix cache, batched
decode): greedy tokens equal transformers' for prompts longer than the window / the top-k."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from paged_harness import hf_reference
from test_deepseek_v32 import build as build_v32
from test_granite import PROMPTS
from test_granite import build as build_granite

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def check(hf_model: torch.nn.Module, path: Path, prompts: list[list[int]]) -> None:
    llm = LLM(
        path, backend="torch_ref", block_size=4, max_num_batched_tokens=8
    )  # prompts span several chunks
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)  # prefix-cache hits on the prompts' full blocks
    assert any(o.num_cached_tokens for o in again)
    for prompt, out, cached in zip(prompts, first, again, strict=True):
        want, _ = hf_reference(hf_model, prompt, GREEDY.max_tokens)
        assert out.token_ids == want and cached.token_ids == want


@pytest.mark.parametrize("name", ["granite_swa", "granitemoe_swa"])
def test_granite_swa_through_the_engine(name: str, tmp_path: Path) -> None:
    hf_model, _ = build_granite(name, tmp_path)
    check(hf_model, tmp_path / name, PROMPTS)


def test_deepseek_v32_sparse_through_the_engine(tmp_path: Path) -> None:
    hf_model, _ = build_v32(tmp_path, index_topk=4)
    check(hf_model, tmp_path / "v32_4", PROMPTS)
