"""The reference for fp8 KV caches: transformers' own forward (float64) with each layer's keys and
values rounded as an fp8 cache stores them, so later layers see what the engine's cache gives them.

Per layer, what the engine writes is recorded before rounding: MLA (DeepSeek) the latent kv_c (the
kv_a_layernorm output) and the roped rope key k_pe, which the cache holds as one record with one
scale; MHA (Llama, Granite) the roped keys and the values [S, H_kv, D], with a scale each. Then
they are rounded, x -> float8_e4m3fn(clamp(x / scale, -448, 448)) * scale, with the scales given
(the engine's calibrated ones, a checkpoint's), and the model goes on from the rounded values.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.masking_utils import eager_mask

FP8_MAX = 448.0
_INTERFACE = "jackfield_fp8_reference"


@dataclass(frozen=True)
class Fp8Reference:
    """One prompt through the reference."""

    logits: torch.Tensor  # [S, vocab] float64
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, before rounding (MLA: kv_c, k_pe; MHA: k, v)


def round_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an fp8 cache with per-tensor `scale` gives it back (x's dtype)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def float64_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[S, vocab] logits of `prompt` through a float64 copy of `model`, nothing rounded."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        return _float64(model)(ids, attention_mask=torch.ones_like(ids)).logits[0]


def _float64(model: PreTrainedModel) -> PreTrainedModel:
    reference = copy.deepcopy(model).cpu().double().eval()
    reference.config._experts_implementation = "eager"  # a loop: grouped_mm has no float64
    return reference


def fp8_reference(model: PreTrainedModel, prompt: list[int],
                  scales: Sequence[Sequence[float]]) -> Fp8Reference:
    """`prompt` through a float64 copy of `model` whose layer i rounds its KV with `scales[i]`:
    (record,) for an MLA model, (key, value) for an MHA one."""
    reference = _float64(model)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    rounding = _rounding_mla if hasattr(reference.config, "kv_lora_rank") else _rounding_mha
    with rounding(reference, scales, kv), torch.no_grad():
        ids = torch.tensor([prompt])
        logits = reference(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return Fp8Reference(logits, [kv[i] for i in range(len(kv))])


@contextmanager
def _rounding_mla(model: PreTrainedModel, scales: Sequence[Sequence[float]],
                  kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """kv_a_layernorm's output (kv_c) and expand_kv's roped k_rot, recorded then rounded."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn, (scale,) = layer.self_attn, scales[i]
        latents: list[torch.Tensor] = []

        def keep_latent(_module: torch.nn.Module, _inputs: object, out: torch.Tensor,
                        latents: list[torch.Tensor] = latents, scale: float = scale) -> torch.Tensor:
            latents.append(out[0].clone())
            return round_fp8(out, scale)

        def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor, i: int = i, scale: float = scale,
                      latents: list[torch.Tensor] = latents,
                      original: Callable = attn.expand_kv) -> tuple[torch.Tensor, torch.Tensor]:
            kv[i] = (latents.pop(), k_rot[0, 0].clone())
            return original(kv_nope, round_fp8(k_rot, scale))

        handles.append(attn.kv_a_layernorm.register_forward_hook(keep_latent))
        attn.expand_kv = expand_kv
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _rounding_mha(model: PreTrainedModel, scales: Sequence[Sequence[float]],
                  kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """The keys (roped) and values the attention function receives, recorded then rounded; the
    family's own eager attention goes on from there."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        i = module.layer_idx
        k_scale, v_scale = scales[i]
        kv[i] = (key[0].transpose(0, 1).clone(), value[0].transpose(0, 1).clone())  # [S, H_kv, D]
        eager = importlib.import_module(type(module).__module__).eager_attention_forward
        return eager(module, query, round_fp8(key, k_scale), round_fp8(value, v_scale), *args, **kwargs)

    AttentionInterface.register(_INTERFACE, attention)
    AttentionMaskInterface.register(_INTERFACE, eager_mask)  # else a custom attention gets no mask
    saved = model.config._attn_implementation
    model.config._attn_implementation = _INTERFACE
    try:
        yield
    finally:
        model.config._attn_implementation = saved
