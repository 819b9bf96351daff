"""Standard-attention models through the engine on cpu_amx: the same greedy tokens as transformers
(float32), with chunked prefills beside decodes in one step over scattered paged blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import greedy_reference, write_granite

MAX_NEW = 8


@pytest.mark.parametrize(
    "name,config",
    [
        ("llama", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)),  # GQA 3, as SmolLM2
        ("granite_swa", {}),  # windows of 3 tokens on three layers, one full layer, sinks
    ],
)
def test_auto_picks_cpu_amx_and_generates_like_transformers(
    name: str, config: dict[str, object], tmp_path: Path, rng_seed: int
) -> None:
    hf_model = write_granite(name, tmp_path, seed=rng_seed % 1000, **config)
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 11, 23, 30)]
    # 16 tokens a step: the long prompts are prefilled in chunks beside the others' decodes.
    llm = LLM(tmp_path, backend="auto", dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert {role: choice.name for role, choice in llm.engine.backend_choices.items()} == {
        "prefill": "cpu_amx", "decode": "cpu_amx"
    }
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        want, _ = greedy_reference(hf_model, prompt, MAX_NEW)
        assert output.token_ids == want, f"prompt of {len(prompt)} tokens"
