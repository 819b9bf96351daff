"""Hybrid models (Qwen3-Next, Granite 4.0 hybrid) inside the engine on a GPU: the Triton
recurrences, decode steps replayed from CUDA graphs (state slots read from static buffers,
padded rows on the pool's padding slot), prefill chunks beside decodes, and n-gram verify steps
rolled back. Replayed and eager runs give the same greedy tokens, and the float32 runs give
transformers' greedy tokens.

  pytest tests/test_gpu_hybrid.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import greedy_reference, write_hybrid

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NGRAM = {"speculative.method": "ngram", "speculative.num_speculative_tokens": 3,
         "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 3}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 97, (6,), generator=g).tolist()
    return [motif * 4, [42], *(torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 40, 90, 11))]


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid_dense_nope", "granitemoehybrid"])
def test_replayed_decode_matches_eager_and_transformers(family: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convs, as on the CPU
    hf_model = write_hybrid(family, tmp_path)
    base = {"engine.device": "cuda", "model.dtype": "float32", "engine.max_num_batched_tokens": 64,
            "engine.max_num_seqs": 8}
    batch = prompts()
    eager = LLM(str(tmp_path), **base, **{"engine.cuda_graphs": False})
    want = [o.token_ids for o in eager.generate(batch, GREEDY)]
    replayed = LLM(str(tmp_path), **base)
    if family != "granitemoehybrid":  # MoE experts loop on float32 (no grouped matmuls): eager
        assert replayed.engine.runner.graphs is not None, replayed.engine.runner.decode_graphs_off
    assert [o.token_ids for o in replayed.generate(batch, GREEDY)] == want
    assert [o.token_ids for o in LLM(str(tmp_path), **base, **NGRAM).generate(batch, GREEDY)] == want
    hf_model = hf_model.cuda()
    for prompt, tokens in zip(batch, want, strict=True):
        assert greedy_reference(hf_model, prompt, GREEDY.max_tokens)[0] == tokens
