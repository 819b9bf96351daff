"""rocm_aiter_mla through the engine, over the AITER emulator: a DeepSeek-V3 checkpoint at AITER's
widths (16 heads, kv_lora_rank 512, rope 64) generates as it does on torch_ref, with prefill
chunks beside decodes in one step over scattered paged blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.plugins import Registered, get_registry
from jackfield.specs import AttentionBackendSpec
from jackfield.testing.checkpoints import write_deepseek

from .aiter_emulator import EmulatedAiter
from .emulated import emulated_backend

MAX_NEW = 6


def test_generates_as_torch_ref_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng_seed: int) -> None:
    """bf16 both ways: the same greedy tokens and their logprobs within bf16's noise. Dense layers
    only: a random MoE router's near-ties would flip experts on any rounding difference."""
    write_deepseek("v3", tmp_path, seed=rng_seed % 1000, num_attention_heads=16, num_key_value_heads=16,
                   kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                   first_k_dense_replace=3)
    aiter = EmulatedAiter("gfx950")
    backend = emulated_backend(aiter)
    spec = AttentionBackendSpec(name="rocm_aiter_mla", factory=backend, capabilities=backend.capabilities,
                                availability=backend.availability, priority=60)
    monkeypatch.setitem(get_registry().entries["attention"], "rocm_aiter_mla",
                        Registered("attention", spec, "rocm_aiter", "jackfield-rocm-aiter"))
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (2, 9, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    runs = {}
    for name in ("rocm_aiter_mla", "torch_ref"):
        # 8 tokens a step: the longer prompts are prefilled in chunks beside the others' decodes
        llm = LLM(tmp_path, backend=name, dtype="bfloat16", block_size=4, max_num_batched_tokens=8)
        assert {choice.name for choice in llm.engine.backend_choices.values()} == {name}
        runs[name] = llm.generate(prompts, params)
    assert aiter.calls, "no decode step reached AITER"
    for got, want in zip(runs["rocm_aiter_mla"], runs["torch_ref"], strict=True):
        got_sample, want_sample = got.outputs[0], want.outputs[0]
        assert got_sample.token_ids == want_sample.token_ids
        assert got_sample.logprobs is not None and want_sample.logprobs is not None
        for token, got_lp, want_lp in zip(want_sample.token_ids, got_sample.logprobs, want_sample.logprobs,
                                          strict=True):
            assert abs(got_lp[token] - want_lp[token]) < 0.05
