"""The transformers references of jackfield.testing.checkpoints: the PyTorch paths where
transformers would bind another package's kernels, and the Granite-hybrid check that tells a
transformers whose Mamba2 normalizes over all groups at once (before 5.23) from Granite 4.0's."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from jackfield.testing.checkpoints import granite_hybrid_reference_problem, greedy_reference, write_hybrid
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
from transformers.models.granitemoehybrid import modeling_granitemoehybrid
from transformers.models.qwen3_next import modeling_qwen3_next


def test_greedy_reference_runs_transformers_torch_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        rng_seed: int) -> None:
    """A package that imports (as flash-linear-attention does where installed) and whose kernels
    refuse CPU tensors, bound by transformers' own decorator in place of Qwen3-Next's gated delta
    rule: the model fails, greedy_reference does not, and gives the tokens of before."""
    model = write_hybrid("qwen3_next", tmp_path)
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(rng_seed)).tolist()
    before = greedy_reference(model, prompt, 4)[0]

    def cuda_only(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a Triton kernel handed CPU tensors")

    package = types.ModuleType("cuda_only_kernels")
    package.chunk_gated_delta_rule = package.fused_recurrent_gated_delta_rule = cuda_only  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, package.__name__, package)
    for name, kernel in (("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"),
                         ("torch_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule")):
        original = getattr(modeling_qwen3_next, name).__wrapped__
        bound = use_kernel_func_from_hub_with_fallback(kernel, package.__name__)(original)
        monkeypatch.setattr(modeling_qwen3_next, name, bound)
    with pytest.raises(RuntimeError, match="CPU tensors"), torch.no_grad():
        model(torch.tensor([prompt]))
    assert greedy_reference(model, prompt, 4)[0] == before
    with pytest.raises(RuntimeError, match="CPU tensors"), torch.no_grad():  # the binding is back
        model(torch.tensor([prompt]))


def whole_width_norm(self: torch.nn.Module, hidden_states: torch.Tensor,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """transformers 5.17's GraniteMoeHybridRMSNormGated.forward: one RMS over the whole width."""
    dtype = hidden_states.dtype
    hidden_states = hidden_states.float()
    if gate is not None:
        hidden_states = hidden_states * torch.nn.functional.silu(gate.float())
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


@pytest.mark.parametrize("family", ["granitemoehybrid", "granitemoehybrid_dense_nope"])
def test_granite_hybrid_reference_problem_tells_a_norm_over_all_groups(
        family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grouped = write_hybrid(family, tmp_path / "grouped")
    one_group = write_hybrid(family, tmp_path / "one", mamba_n_groups=1)
    assert grouped.config.mamba_n_groups == 2
    assert granite_hybrid_reference_problem(grouped) is None  # the tests' transformers: >= 5.23
    monkeypatch.setattr(modeling_granitemoehybrid.GraniteMoeHybridRMSNormGated, "forward", whole_width_norm)
    problem = granite_hybrid_reference_problem(grouped)
    assert problem is not None and "over all 2 groups at once" in problem
    assert granite_hybrid_reference_problem(one_group) is None  # one group: the two norms agree


def test_no_granite_hybrid_reference_problem_outside_granite_hybrids(tmp_path: Path) -> None:
    assert granite_hybrid_reference_problem(write_hybrid("qwen3_next", tmp_path)) is None
