"""Embeddings: one pooled vector per prompt from a model's final hidden states.

A DeepSeek checkpoint whose config.json says `"is_causal": false` (the field transformers reads
too) is a bidirectional embedding model: the registered DeepSeek class serves it with every layer
in the expanded (non-MLA) form on a standard attention backend (deepseek.ExpandedMLAAttention).
`"pooling"` in config.json picks mean, last or cls; the default is mean for bidirectional models
and last (the only token that saw the whole prompt) for causal ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

POOLING_TYPES = ("mean", "last", "cls")


def pooling_of(hf_config: Mapping[str, object]) -> str:
    """The pooling a config.json dict (or `PretrainedConfig.to_dict()`) asks for."""
    default = "mean" if hf_config.get("is_causal") is False else "last"
    pooling = hf_config.get("pooling") or default
    if pooling not in POOLING_TYPES:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLING_TYPES)}")
    return str(pooling)


def pool(hidden: torch.Tensor, query_start_loc: list[int], pooling: str) -> torch.Tensor:
    """hidden [T, D] of B whole prompts (prompt b owns rows qsl[b]:qsl[b+1]) -> [B, D] float32."""
    if pooling not in POOLING_TYPES:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLING_TYPES)}")
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    if any(e <= s for s, e in zip(starts, ends, strict=True)) or query_start_loc[-1] != hidden.shape[0]:
        raise ValueError(
            f"query_start_loc {query_start_loc} does not split {hidden.shape[0]} rows into non-empty prompts"
        )
    if pooling == "cls":
        return hidden[starts].float()
    if pooling == "last":
        return hidden[[e - 1 for e in ends]].float()
    return torch.stack([hidden[s:e].float().mean(dim=0) for s, e in zip(starts, ends, strict=True)])
