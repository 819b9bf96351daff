"""A third-party Jackfield plugin: a greedy sampler named `example_greedy` and the Qwen2 model
family (`Qwen2ForCausalLM`, in qwen2.py).

Install it (`pip install -e examples/third_party_plugin`), then `jackfield plugins` lists it,
`[sampler] name = "example_greedy"` selects the sampler, and a Qwen2 checkpoint directory loads.
"""

from __future__ import annotations

import jackfield
import torch
from jackfield.contracts.sampler import Sampler, SamplerOutput, SamplingMetadata
from jackfield.specs import ModelSpec, SamplerSpec

JACKFIELD_API = ">=1.0,<2"  # the core plugin-API versions this plugin was written for


class GreedySampler(Sampler):
    """Always the most likely token (lowest id on ties); ignores temperature and seeds."""

    name = "example_greedy"

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
        finite = torch.isfinite(logits)
        masked = torch.where(finite, logits.float(), torch.finfo(torch.float32).min)
        return SamplerOutput(token_ids=masked.argmax(dim=-1), invalid_rows=~finite.any(dim=-1))


@jackfield.hookimpl
def register_samplers() -> list[SamplerSpec]:
    return [SamplerSpec(name="example_greedy", factory=GreedySampler, description="example: argmax")]


@jackfield.hookimpl
def register_models() -> list[ModelSpec]:
    return [ModelSpec(name="Qwen2ForCausalLM", factory="jackfield_example_plugin.qwen2:Qwen2ForCausalLM",
                      description="example: Qwen2 (GQA with q/k/v bias)")]
