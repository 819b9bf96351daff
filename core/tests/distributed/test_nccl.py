"""The NCCL path on GPUs: DCP's collectives at world size 1 (one GPU), and with two GPUs the
engine's greedy tokens under tp 2, dcp 2 equal to one GPU's (float32, torch_ref)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.testing.checkpoints import write_deepseek, write_granite
from jackfield.testing.torchrun import torchrun

SEED = 5252
HERE = Path(__file__).parent
PROMPTS = [[7], [5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 14]]
COMMON = {"backend": "torch_ref", "block_size": 4, "device": "cuda", "dtype": "float32", "cuda_graphs": False}


@pytest.mark.gpu
def test_nccl_collectives_at_world_size_one() -> None:
    run = torchrun(1, [str(HERE / "nccl_worker.py")], timeout_s=300)
    assert "nccl collectives ok" in run.stdout


@pytest.mark.gpu
def test_two_gpus_generate_what_one_gpu_does(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs: this machine has {torch.cuda.device_count()}")
    print(f"seed {SEED}")
    write_deepseek("v3", tmp_path / "deepseek", seed=SEED)
    write_granite("llama", tmp_path / "llama", seed=SEED)
    parallel = {"tp2": {"tensor_parallel_size": 2}, "dcp2": {"tensor_parallel_size": 2, "dcp_size": 2}}
    jobs = [{"name": f"{model}-{name}", "model": str(tmp_path / model), "config": {**COMMON, **config},
             "prompts": PROMPTS, "max_tokens": 4}
            for model in ("deepseek", "llama") for name, config in parallel.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torchrun(2, [str(HERE / "parallel_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")],
             timeout_s=600)
    results = json.loads((tmp_path / "out.json").read_text())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for model in ("deepseek", "llama"):
        want = [o.token_ids for o in LLM(tmp_path / model, **COMMON).generate(PROMPTS, params)]
        for name in parallel:
            assert results[f"{model}-{name}"]["tokens"] == want, name
