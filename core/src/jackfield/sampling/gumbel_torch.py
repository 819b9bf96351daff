"""The PyTorch Gumbel-max sampler: materializes the noise, runs on any device.

The Triton kernel (gumbel_triton.py) computes the same scores without the noise tensor; both
return bit-identical (token, score) pairs.
"""

from __future__ import annotations

import torch

from jackfield.sampling.noise import gumbel_noise


def gumbel_argmax_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    cutoff: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the argmax (lowest index on ties) of the score and the score itself.

    score = logit (temperature 0) or logit / temperature + noise; -inf where the logit is not
    finite or below the row's cutoff. A score of -inf means the row had nothing to sample.
    """
    x = logits.to(torch.float32)
    keep = torch.isfinite(x)
    if cutoff is not None:
        keep &= x >= cutoff.unsqueeze(1)
    greedy = temperature == 0
    token_ids = torch.arange(x.shape[1], device=x.device, dtype=torch.int64)
    noise = gumbel_noise(seeds.unsqueeze(1), positions.unsqueeze(1), token_ids.unsqueeze(0))
    safe_t = torch.where(greedy, 1.0, temperature.to(torch.float32))
    sampled = x / safe_t.unsqueeze(1) + noise
    score = torch.where(greedy.unsqueeze(1), x, sampled)
    score = torch.where(keep, score, float("-inf"))
    token = torch.argmax(score, dim=1)  # the first maximum: lowest index on ties
    return token, score.gather(1, token.unsqueeze(1)).squeeze(1)
