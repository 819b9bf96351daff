"""The pd connector on a GPU: a prefill engine (child process) and a decode engine sharing one
GPU, bf16, cuda_attn with decode graphs, a Llama and a Granite SWA model (a window group beside
the full one). The prompts' whole blocks are gathered on the producer's compute stream, cross the
host, and are loaded into the consumer's cache; the greedy tokens are one engine's up to bf16
rounding (the consumer computes each prompt's last partial block itself, a different split of
the same prompt), and every block the producer sent was loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.commands.pd import PDLLM
from jackfield.testing.checkpoints import write_granite
from jackfield.testing.checks import greedy_runs_agree

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
BASE = {"engine.device": "cuda", "attention.backend": "cuda_attn", "model.dtype": "bfloat16",
        "engine.block_size": 16, "engine.max_num_seqs": 8, "engine.gpu_memory_fraction": 0.05}


@pytest.mark.parametrize("family", ["llama", "granite_swa"])
def test_pd_on_one_gpu_gives_one_engines_tokens(family: str, tmp_path: Path, rng_seed: int) -> None:
    extra = {"sliding_window": 64} if family == "granite_swa" else {}
    write_granite(family, tmp_path, seed=rng_seed % 1000, **SHAPE, **extra)
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (700, 33, 16, 250, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    single = LLM(str(tmp_path), **BASE)
    want = single.generate(prompts, params, use_tqdm=False)
    del single
    torch.cuda.empty_cache()
    with PDLLM(str(tmp_path), **BASE, **{"kv_connector.options": {"timeout_s": 30.0}}) as pair:
        before = pair.producer_stats()  # the prefill engine's warm-up request is counted too
        got = pair.generate(prompts, params, use_tqdm=False)
        decode, prefill = pair.engine.kv_connector_stats(), pair.producer_stats()
        assert pair.producer_error is None
    assert greedy_runs_agree(want, got) >= 30
    assert decode is not None and prefill is not None and before is not None
    assert prefill["exported_requests"] - before["exported_requests"] == len(prompts)
    assert prefill["exported_blocks"] - before["exported_blocks"] == decode["received_chunks"] > 0
    assert decode["hit_tokens"] == sum(len(p) // 16 * 16 for p in prompts)
    assert decode["failed_loads"] == 0 and decode["aborted_transfers"] == 0
