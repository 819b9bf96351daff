"""The two built-in Samplers: `murmur3` (the default) and `torch_ref` (the reference)."""

from __future__ import annotations

import torch

from jackfield.contracts.sampler import Sampler, SamplerOutput, SamplingMetadata
from jackfield.sampling.filters import filter_cutoffs, finite_or_neg_inf
from jackfield.sampling.noise import DRAFT_POSITION_OFFSET, UNIFORM64_HI_DOMAIN, murmur3_hash32
from jackfield.sampling.processors import apply_processors, top_logprobs
from jackfield.sampling.sample import Impl, sample_with_scores, validate_inputs


def _noise_positions(metadata: SamplingMetadata) -> torch.Tensor:
    # A drafter's tokens come from a stream disjoint from the target model's.
    return metadata.positions + DRAFT_POSITION_OFFSET if metadata.drafting else metadata.positions


class Murmur3Sampler(Sampler):
    """Seeded Gumbel-max with Murmur3 noise: a pure function of (seed, position, token id), so a
    request's tokens are the same on any device, batch composition and batch position."""

    name = "murmur3"
    records_plain_draws = True  # the temperature-only Gumbel kernels never sync

    def __init__(self, impl: Impl = "auto") -> None:
        self.impl: Impl = impl

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        adjusted = apply_processors(logits, metadata)
        m = metadata
        tokens, scores = sample_with_scores(
            adjusted, m.temperature, m.seeds, _noise_positions(m), m.top_k, m.top_p, m.min_p, impl=self.impl
        )
        ids, values = top_logprobs(logits, m.max_num_logprobs)
        return SamplerOutput(tokens, ids, values, invalid_rows=scores == float("-inf"))


def generator_seed(seed: int, position: int) -> int:
    """A 64-bit torch.Generator seed for one (request seed, position)."""
    s, p = torch.tensor(seed, dtype=torch.int64), torch.tensor(position, dtype=torch.int64)
    lo = int(murmur3_hash32(s, p, torch.tensor(0)))
    hi = int(murmur3_hash32(s, p, torch.tensor(0), domain=UNIFORM64_HI_DOMAIN))
    return (hi << 32) | lo


class TorchRefSampler(Sampler):
    """softmax + top-k / top-p / min-p + torch.multinomial, one torch.Generator per row seeded
    from (seed, position): reproducible per request, but not the murmur3 stream."""

    name = "torch_ref"

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        m = metadata
        validate_inputs(logits, m.temperature, m.seeds, m.positions, m.top_k, m.top_p, m.min_p)
        x = finite_or_neg_inf(apply_processors(logits, m))
        invalid = ~torch.isfinite(x).any(dim=1)
        tokens = torch.argmax(x, dim=1)  # greedy rows (and token 0 for rows with nothing finite)
        cutoff = filter_cutoffs(x, m.temperature, m.top_k, m.top_p, m.min_p)
        if cutoff is not None:
            x = torch.where(x >= cutoff.unsqueeze(1), x, float("-inf"))
        sampled_rows = ((m.temperature > 0) & ~invalid).nonzero().flatten().tolist()
        seeds, positions = m.seeds.tolist(), _noise_positions(m).tolist()
        for row in sampled_rows:
            probs = torch.softmax(x[row] / m.temperature[row], dim=0)
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(generator_seed(seeds[row], positions[row]))
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
        ids, values = top_logprobs(logits, m.max_num_logprobs)
        return SamplerOutput(tokens, ids, values, invalid_rows=invalid)
