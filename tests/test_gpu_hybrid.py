"""Hybrid models (Qwen3-Next, Granite 4.0 hybrid) inside the engine on a GPU: the Triton
recurrences, decode steps replayed from CUDA graphs (state slots read from static buffers,
padded rows on the pool's padding slot), prefill chunks beside decodes, and n-gram verify steps
rolled back.

- bf16, as users run: cuda_attn (which records decode graphs) and, for the MoE variants, the
  experts as grouped matmuls (no host sync on compute capability >= 9.0): every family records
  its decode graphs, and replayed and n-gram runs give the eager run's greedy tokens up to bf16
  rounding (greedy_runs_agree). The attention heads are 32 wide here: cuda_attn's smallest.
- float32, eager (torch_ref takes float32; cuda_attn does not, and MoE experts loop with a host
  sync in float32): greedy tokens, with and without n-gram drafts, equal the CPU engine's and
  transformers' float32 tokens on the CPU (its PyTorch paths, as in
  core/tests/models/test_hybrid_engine.py). A transformers that computes another Mamba2
  (granite_hybrid_reference_problem: before 5.23, the gated norm over all groups at once) is no
  oracle: then the CPU engine alone is, which CI pins against transformers >= 5.23.

  pytest tests/test_gpu_hybrid.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.engine.cuda_graphs import DecodeGraphs
from jackfield.testing.checkpoints import granite_hybrid_reference_problem, greedy_reference, write_hybrid
from jackfield.testing.checks import greedy_runs_agree

pytestmark = pytest.mark.gpu

FAMILIES = ["qwen3_next", "granitemoehybrid_dense_nope", "granitemoehybrid"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NGRAM = {"speculative.method": "ngram", "speculative.num_speculative_tokens": 3,
         "speculative.prompt_lookup_min": 1, "speculative.prompt_lookup_max": 3}
# attention heads of 32 (cuda_attn's head sizes start there); the recurrent layers keep their shapes
CUDA_ATTN_HEADS = {"qwen3_next": {"head_dim": 32}, "granitemoehybrid_dense_nope": {"hidden_size": 128},
                   "granitemoehybrid": {"hidden_size": 128}}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 97, (6,), generator=g).tolist()
    return [motif * 4, [42], *(torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 40, 90, 11))]


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_and_ngram_decodes_agree_with_eager_in_bf16(family: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    write_hybrid(family, tmp_path, **CUDA_ATTN_HEADS[family])
    base = {"engine.device": "cuda", "model.dtype": "bfloat16", "attention.backend": "cuda_attn",
            "engine.max_num_batched_tokens": 64, "engine.max_num_seqs": 8, "engine.gpu_memory_fraction": 0.05}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    batch = prompts()
    want = LLM(str(tmp_path), **base, **{"engine.cuda_graphs": False}).generate(batch, params)
    replays: list[int] = []
    recorded_run = DecodeGraphs.run

    def counting_run(self: DecodeGraphs, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        replays.append(len(args[0]))
        return recorded_run(self, *args, **kwargs)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    replayed = LLM(str(tmp_path), **base)
    assert replayed.engine.runner.graphs is not None, replayed.engine.runner.decode_graphs_off
    compared = greedy_runs_agree(want, replayed.generate(batch, params))
    assert replays and set(replays) - set(replayed.engine.runner.graphs.sizes), replays  # padded batches too
    print(f"{family}: {len(replays)} decode steps replayed, {compared} greedy steps agree with eager")
    assert greedy_runs_agree(want, LLM(str(tmp_path), **base, **NGRAM).generate(batch, params))


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_tokens_equal_the_cpu_engine_and_transformers(family: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convs, as on the CPU
    hf_model = write_hybrid(family, tmp_path)  # stays on the CPU: transformers' float32 oracle
    base = {"model.dtype": "float32", "engine.max_num_batched_tokens": 64, "engine.max_num_seqs": 8}
    cuda = {**base, "engine.device": "cuda", "engine.cuda_graphs": False, "engine.gpu_memory_fraction": 0.05}
    cpu = {**base, "engine.device": "cpu", "attention.backend": "torch_ref"}
    batch = prompts()
    want = [o.token_ids for o in LLM(str(tmp_path), **cpu).generate(batch, GREEDY)]
    problem = granite_hybrid_reference_problem(hf_model)
    if problem is None:
        assert want == [greedy_reference(hf_model, prompt, GREEDY.max_tokens)[0] for prompt in batch]
    else:
        print(f"{family}: the CPU engine is the oracle: {problem}")
    assert [o.token_ids for o in LLM(str(tmp_path), **cuda).generate(batch, GREEDY)] == want
    assert [o.token_ids for o in LLM(str(tmp_path), **cuda, **NGRAM).generate(batch, GREEDY)] == want
