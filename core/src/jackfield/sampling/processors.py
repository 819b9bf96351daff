"""Logit bias, allowed-token lists and logprobs: the per-request steps around sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jackfield.contracts.sampler import SamplingMetadata, SamplingParams


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


def apply_bias_and_mask(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logits + logit_bias, -inf where the allowed-token mask is False (the logits if neither)."""
    bias, mask = metadata.logit_bias, metadata.allowed_token_mask
    for name, t, dtype in (("logit_bias", bias, torch.float32), ("allowed_token_mask", mask, torch.bool)):
        if t is not None and (t.shape != logits.shape or t.dtype != dtype or t.device != logits.device):
            raise ValueError(
                f"{name} must be {dtype} {tuple(logits.shape)} on {logits.device} like the logits, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if bias is None and mask is None:
        return logits
    x = logits.to(torch.float32)
    if bias is not None:
        x = x + bias
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    return x


def top_logprobs(logits: torch.Tensor, k: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(token ids int64 [R, k], values float32 [R, k]): the top-k of log_softmax(raw logits)."""
    if k is None:
        return None, None
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    values, ids = torch.topk(logprobs, min(k, logits.shape[1]), dim=-1)
    return ids, values
