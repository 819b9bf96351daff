"""Out-of-range per-row values, defined once for both implementations of the sampler.

A temperature below GREEDY_BELOW, negative or NaN is greedy, +inf is the largest float32 (uniform
sampling without an inf * 0); a NaN top_p is off; min_p is clamped to [0, 1] (a larger one would
mask the most likely token too), NaN is off. SamplingParams rejects these at the engine's entry;
the functional API defines them. The PyTorch path applies `sanitized`; the Triton kernels apply
the same rules as they load each row's values (gumbel_triton.load_temperature, filters_triton),
which saves the launches.
"""

from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM): logits / T would overflow
F32_MAX = 3.4028234663852886e38


def sanitized(
    temperature: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The per-row values made safe (see the module docstring) without a device sync, dense."""
    temperature = torch.where(temperature >= GREEDY_BELOW, temperature, 0.0).clamp(max=F32_MAX).contiguous()
    if top_p is not None:
        top_p = torch.nan_to_num(top_p, nan=1.0).contiguous()
    if min_p is not None:
        min_p = torch.nan_to_num(min_p, nan=0.0).clamp(0.0, 1.0).contiguous()
    return temperature, top_p, min_p
