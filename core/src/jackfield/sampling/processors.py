"""Logit bias, allowed-token lists, penalties and logprobs: the per-request steps around sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jackfield.contracts.sampler import Penalties, SamplingMetadata, SamplingParams


def check_named_tokens(params: SamplingParams, vocab: int) -> None:
    """logit_bias, allowed_token_ids and stop_token_ids must name tokens of the vocabulary [0, vocab)."""
    fields = {"logit_bias": tuple(params.logit_bias or ()),
              "allowed_token_ids": params.allowed_token_ids or (),
              "stop_token_ids": params.stop_token_ids}
    for name, token_ids in fields.items():
        outside = [t for t in token_ids if t >= vocab]
        if outside:
            raise ValueError(f"SamplingParams.{name}: token ids {outside[:8]} are outside the "
                             f"vocabulary [0, {vocab})")


def bias_and_mask_from_params(
    params: Sequence[SamplingParams], vocab: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Dense SamplingMetadata.logit_bias [R, V] and allowed_token_mask [R, V] (None when unused)."""
    for p in params:
        check_named_tokens(p, vocab)
    bias = mask = None
    if any(p.logit_bias for p in params):
        bias = torch.zeros((len(params), vocab), dtype=torch.float32)
        for row, p in enumerate(params):
            for token, value in (p.logit_bias or {}).items():
                bias[row, int(token)] = float(value)
        bias = bias.to(device)
    if any(p.allowed_token_ids is not None for p in params):
        mask = torch.ones((len(params), vocab), dtype=torch.bool)
        for row, p in enumerate(params):
            if p.allowed_token_ids is not None:
                mask[row] = False
                mask[row, list(p.allowed_token_ids)] = True
        mask = mask.to(device)
    return bias, mask


def penalties_from_rows(params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                        outputs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Penalties:
    """Penalties for rows whose request has `params`, `prompts` and the tokens generated before
    the row's position, `outputs`."""

    def scatter(token_lists: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        rows = [r for r, tokens in enumerate(token_lists) for _ in tokens]
        ids = [t for tokens in token_lists for t in tokens]
        out = torch.zeros((len(token_lists), vocab), dtype=dtype, device=device)
        index = (torch.tensor(rows, dtype=torch.int64, device=device),
                 torch.tensor(ids, dtype=torch.int64, device=device))
        return out.index_put_(index, torch.ones(len(ids), dtype=dtype, device=device), accumulate=True)

    # Rows without a penalty get no token lists: their scatter is wasted work and their values are off.
    off = [not p.penalized for p in params]
    return Penalties(
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        output_counts=scatter([() if o else t for o, t in zip(off, outputs, strict=True)], torch.int32),
        in_prompt=scatter([() if o else t for o, t in zip(off, prompts, strict=True)], torch.int32) > 0,
    )


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """vLLM's (and OpenAI's) definitions, in float32: a token seen in the prompt or the output has
    its logit divided by repetition_penalty when positive, multiplied when not; then
    frequency_penalty x its output count and presence_penalty once if generated are subtracted."""
    p = penalties
    counts = p.output_counts.to(torch.float32)
    seen = p.in_prompt | (p.output_counts > 0)
    repetition = torch.where(seen, p.repetition.unsqueeze(1), 1.0)
    x = logits.to(torch.float32)
    x = torch.where(x > 0, x / repetition, x * repetition)
    return x - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * (counts > 0).to(torch.float32)


def apply_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The logits every sampler samples from, in vLLM's order: + logit_bias, -inf where the
    allowed-token mask is False, then the penalties (the logits themselves if none applies)."""
    bias, mask, penalties = metadata.logit_bias, metadata.allowed_token_mask, metadata.penalties
    tensors = [("logit_bias", bias, torch.float32), ("allowed_token_mask", mask, torch.bool)]
    if penalties is not None:
        tensors += [("penalties.output_counts", penalties.output_counts, torch.int32),
                    ("penalties.in_prompt", penalties.in_prompt, torch.bool)]
    for name, t, dtype in tensors:
        if t is not None and (t.shape != logits.shape or t.dtype != dtype or t.device != logits.device):
            raise ValueError(
                f"{name} must be {dtype} {tuple(logits.shape)} on {logits.device} like the logits, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if bias is None and mask is None and penalties is None:
        return logits
    x = logits.to(torch.float32)
    if bias is not None:
        x = x + bias
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    if penalties is not None:
        x = apply_penalties(x, penalties)
    return x


def top_logprobs(logits: torch.Tensor, k: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(token ids int64 [R, k], values float32 [R, k]): the top-k of log_softmax(raw logits)."""
    if k is None:
        return None, None
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    values, ids = torch.topk(logprobs, min(k, logits.shape[1]), dim=-1)
    return ids, values
