"""Verify steps replayed from CUDA graphs (1 + k rows a request, padded where a request has fewer
drafts) on a GPU with cuda_attn: Llama and Granite SWA (a sliding-window KV cache group beside the
full one) at head size 64, n-gram drafts. Greedy tokens are those of the run without drafts and of
the eager verify run up to bf16 rounding (greedy_runs_agree), and verify steps did replay."""

from __future__ import annotations

import pytest
import torch
from jackfield.contracts.model import LayerTaps
from jackfield.engine.cuda_graphs import DecodeGraphs
from jackfield.testing.checks import greedy_runs_agree

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=24, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
             initializer_range=0.05)  # fmt: skip
K = 3


def _generate(checkpoint: str, prompts: list[list[int]], settings: dict[str, object]) -> list:
    from jackfield import LLM, SamplingParams

    base = {"attention.backend": "cuda_attn", "engine.device": "cuda", "model.dtype": "bfloat16",
            "engine.gpu_memory_fraction": 0.05, "engine.max_num_seqs": 8}
    llm = LLM(checkpoint, **base, **settings)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, logprobs=5, ignore_eos=True))
    del llm
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("family", ["llama", "granite_swa"])
def test_ngram_verify_graphs_give_the_tokens_of_the_run_without_drafts(
    family: str, tmp_path, monkeypatch: pytest.MonkeyPatch, rng_seed: int
) -> None:
    from jackfield.testing.checkpoints import write_granite

    extra = {"sliding_window": 24} if family == "granite_swa" else {}
    write_granite(family, tmp_path, seed=rng_seed % 1000, **SHAPE, **extra)
    gen = torch.Generator().manual_seed(rng_seed)
    # a 24-token vocabulary: the newest token nearly always recurs earlier, so n-gram lookup
    # (from one token on) drafts at most steps, a few drafts of them accepted
    prompts = [torch.randint(0, 24, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    replays: list[int] = []
    recorded_run = DecodeGraphs.run

    def counting_run(self: DecodeGraphs, chunks: list, q: int, taps: LayerTaps | None = None,
                     **kwargs: object) -> torch.Tensor:  # kwargs: async scheduling's in-flight ids
        replays.append(q)
        return recorded_run(self, chunks, q, taps, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    plain = _generate(str(tmp_path), prompts, {})
    ngram = {"speculative.method": "ngram", "speculative.num_speculative_tokens": K,
             "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 3}
    replays.clear()
    spec = _generate(str(tmp_path), prompts, ngram)
    assert replays.count(1 + K) > 0, f"no verify step replayed (rows a request: {sorted(set(replays))})"
    eager = _generate(str(tmp_path), prompts, {**ngram, "engine.cuda_graphs": False})
    assert sum(o.speculative.drafts for o in spec if o.speculative is not None) > 0
    assert greedy_runs_agree(plain, spec) >= 40
    assert greedy_runs_agree(eager, spec) >= 40
