"""Lossless verification of draft tokens (Leviathan et al., 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1), deterministic per (seed, position).

A request drafts x_1..x_k after its verified tokens; the target's forward over them gives its
distributions p_1..p_{k+1}. Draft j is accepted with probability min(1, p_j(x_j) / q_j(x_j)),
where q_j is the distribution it was drawn from (one-hot for a drafter without probabilities,
such as n-gram lookup). At the first rejection the request emits one token drawn from
max(p_j - q_j, 0) renormalized and stops; when every draft is accepted it emits the bonus token,
which the caller draws from p_{k+1} through the normal sampler. Each emitted token is then
distributed exactly as the target alone would have sampled it.

Greedy rows (temperature 0) have p one-hot at the argmax, so the same rule accepts a draft iff it
equals the argmax and emits the argmax at the first mismatch: vLLM's greedy table.

Randomness: the acceptance uniform of draft j is murmur3_uniform64(seed, position_j, ACCEPT_TOKEN)
and the residual draw is a Gumbel-max over murmur3 noise at (seed, position_j, token), so every
outcome is a pure function of (seed, position, token) and a seeded request gives the same tokens
alone and in any batch. Drafters sample from the disjoint stream at position + 2**30
(noise.DRAFT_POSITION_OFFSET), so draft and target noise never coincide.
"""

from __future__ import annotations

import torch

from jackfield.sampling.noise import MASK32, gumbel_noise, murmur3_uniform64

NO_TOKEN = -1
ACCEPT_TOKEN = MASK32  # the token word of the acceptance uniforms: no vocabulary reaches 2**32 - 1


def greedy_accept(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """The greedy rule on host lists (rejection_verify with one-hot p, without the vocabulary-wide
    work): the target's argmax at each draft while it equals the draft, then the argmax at the
    first mismatch, or the bonus target_ids[len(draft_ids)] when every draft matched."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(draft_ids)} drafts need {len(draft_ids) + 1} target tokens, "
                         f"got {len(target_ids)}")
    for j, (draft, target) in enumerate(zip(draft_ids, target_ids, strict=False)):
        if draft != target:
            return target_ids[: j + 1]
    return list(target_ids)


def target_probabilities(logits: torch.Tensor, temperature: torch.Tensor,
                         cutoff: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V]: softmax(logits / T) over the tokens the sampler could draw (finite logits
    at or above the row's cutoff: top-k / top-p / min-p), one-hot at the argmax where T = 0."""
    x = logits.to(torch.float32)
    keep = torch.isfinite(x)
    if cutoff is not None:
        keep &= x >= cutoff.unsqueeze(1)
    greedy = temperature == 0
    safe_t = torch.where(greedy, 1.0, temperature.to(torch.float32)).unsqueeze(1)
    probs = torch.where(keep, x / safe_t, float("-inf")).softmax(dim=-1)
    argmax = torch.where(torch.isfinite(x), x, float("-inf")).argmax(dim=-1)
    one_hot = torch.nn.functional.one_hot(argmax, x.shape[1]).to(torch.float32)
    return torch.where(greedy.unsqueeze(1), one_hot, probs)


def rejection_verify(draft_ids: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     bonus_ids: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     ) -> torch.Tensor:
    """The tokens each request emits, int64 [B, K + 1], NO_TOKEN (-1) past its last one.

    draft_ids int64 [B, K]: each request's drafts, NO_TOKEN-padded at the end (a request may have
    fewer, or none). target_probs [B, K, V]: p_j at each draft's position (target_probabilities).
    draft_probs [B, K, V] or None: q_j each draft was drawn from (None: one-hot, as n-gram).
    bonus_ids int64 [B]: the token sampled from p_{k+1} of each request, emitted when all of its
    drafts are accepted. seeds int64 [B]; positions int64 [B]: the position of each request's
    first draft (draft j sits at positions + j).
    """
    num_reqs, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    device = draft_ids.device
    foreign_q = draft_probs is not None and draft_probs.shape != target_probs.shape
    if target_probs.shape[:2] != (num_reqs, k) or foreign_q:
        raise ValueError(f"draft_ids {tuple(draft_ids.shape)}, target_probs {tuple(target_probs.shape)} and "
                         f"draft_probs {None if draft_probs is None else tuple(draft_probs.shape)} disagree")
    drafted = draft_ids >= 0
    if bool((draft_ids >= vocab).any()) or bool((drafted[:, 1:] & ~drafted[:, :-1]).any()):
        raise ValueError(f"draft ids must be < vocab size {vocab}, padded with {NO_TOKEN} at the end only")
    x = draft_ids.clamp(min=0)
    draft_pos = positions.unsqueeze(1) + torch.arange(k, device=device)
    p_x = target_probs.gather(2, x.unsqueeze(2)).squeeze(2).double()
    q_x = (torch.ones_like(p_x) if draft_probs is None
           else draft_probs.gather(2, x.unsqueeze(2)).squeeze(2).double())
    u = murmur3_uniform64(seeds.unsqueeze(1), draft_pos, torch.full_like(draft_pos, ACCEPT_TOKEN))
    accepted = drafted & (u * q_x < p_x)  # u < p/q without dividing: q_x may be 0 for a foreign q
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)

    # One residual row per request: at its first rejected draft (clamped: unused when none is).
    first = num_accepted.clamp(max=max(k - 1, 0))
    rows = torch.arange(num_reqs, device=device)
    recovered = bonus_ids.clone()
    if k:
        p = target_probs[rows, first].double()
        q = (torch.nn.functional.one_hot(x[rows, first], vocab).double() if draft_probs is None
             else draft_probs[rows, first].double())
        residual = (p - q).clamp(min=0)
        # p == q leaves nothing (such a draft is never rejected; rounding may): fall back to p.
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
        token_ids = torch.arange(vocab, device=device)
        noise = gumbel_noise(seeds.unsqueeze(1), (positions + first).unsqueeze(1), token_ids.unsqueeze(0),
                             fp64=True)
        scores = torch.where(residual > 0, residual.log() + noise, float("-inf"))
        rejected = num_accepted < drafted.sum(dim=1)
        recovered = torch.where(rejected, scores.argmax(dim=1), bonus_ids)

    out = torch.full((num_reqs, k + 1), NO_TOKEN, dtype=torch.int64, device=device)
    columns = torch.arange(k + 1, device=device).unsqueeze(0)
    out[:, :k] = torch.where(columns[:, :k] < num_accepted.unsqueeze(1), draft_ids, NO_TOKEN)
    out.scatter_(1, num_accepted.unsqueeze(1), recovered.unsqueeze(1))
    return out
