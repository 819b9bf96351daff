"""fp8 KV-cache scales: what a checkpoint stores, and which scales a run uses (`KVScalePlan`).

A cache stores clamp(x / scale, -448, 448) as float8_e4m3fn and reads it back as fp8 * scale, one
per-tensor scale per layer: MLA one for its record (kv_c ‖ k_pe), MHA one for keys and one for
values. Checkpoints quantized for vLLM store them beside the attention weights, under the names
vLLM reads (`maybe_remap_kv_scale_name`):
  model.layers.N.self_attn.k_scale, .v_scale                  (llm-compressor, compressed-tensors)
  model.layers.N.self_attn.k_proj.k_scale, .v_proj.v_scale    (NVIDIA ModelOpt)
  model.layers.N.self_attn.kv_scale                           (older exports: keys and values)
An MLA layer's record takes k_scale (or kv_scale), as vLLM's MLA backends do; a v_scale beside it
is not used. q_scale and prob_scale (fp8 attention arithmetic, which Jackfield does not do) are
skipped. The weight loader leaves every name above to this module (`is_kv_scale_tensor`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from safetensors import SafetensorError, safe_open

from jackfield.config import KVScaleChoice
from jackfield.model_files import ModelFileError

KV_SCALE_TENSOR = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.self_attn\.(?:[kv]_proj\.)?(?P<kind>k|v|kv|q|prob)_scale"
)
KVScaleSource = Literal["checkpoint", "calibration", "config"]


def is_kv_scale_tensor(name: str) -> bool:
    """A checkpoint tensor of the attention's fp8 scales (read here, not a model parameter)."""
    return KV_SCALE_TENSOR.fullmatch(name) is not None


@dataclass(frozen=True)
class KVScalePlan:
    """The scales a run's fp8 caches use, per decoder layer: (record,) for MLA, (key, value) for
    MHA. `layers` is None when they are calibrated from the first prefill."""

    source: KVScaleSource
    layers: tuple[tuple[float, ...], ...] | None
    detail: str  # where they come from, in words (doctor and `jackfield run` print it)


@dataclass(frozen=True)
class CheckpointKVScales:
    """The KV scales a checkpoint stores for layers 0..num_layers-1 (later ones, e.g. DeepSeek's
    multi-token-prediction layers, are not run), and every reason they cannot be used."""

    layers: dict[int, tuple[float, ...]]
    names: tuple[str, ...]  # the name forms found, e.g. ("self_attn.k_scale", "self_attn.v_scale")
    problems: tuple[str, ...]


def read_checkpoint_kv_scales(files: Sequence[Path], num_layers: int, mla: bool) -> CheckpointKVScales:
    """The per-layer scales in `files` (safetensors: the names from the headers, then only the
    scale tensors a layer uses)."""
    found: dict[int, dict[str, tuple[Path, str]]] = {}  # layer -> kind -> (file, name)
    for file in files:
        for name in _tensor_names(file):
            match = KV_SCALE_TENSOR.fullmatch(name)
            if match is not None and match["kind"] not in ("q", "prob") and int(match["layer"]) < num_layers:
                found.setdefault(int(match["layer"]), {})[match["kind"]] = (file, name)
    layers: dict[int, tuple[float, ...]] = {}
    forms: set[str] = set()
    problems: list[str] = []
    for layer, kinds in sorted(found.items()):
        chosen = _chosen(kinds, mla)
        if isinstance(chosen, str):
            problems.append(f"layer {layer}: {chosen}")
            continue
        values = [_scale_value(file, name, problems) for file, name in chosen]
        if all(v is not None for v in values):
            layers[layer] = tuple(v for v in values if v is not None)
            forms.update(name.split(f"layers.{layer}.", 1)[1] for _, name in chosen)
    missing = [i for i in range(num_layers) if i not in found]
    if found and missing:
        problems.append(f"the checkpoint has KV scales for layers {sorted(found)} but not for {missing}")
    return CheckpointKVScales(layers, tuple(sorted(forms)), tuple(problems))


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{file}: not a readable safetensors file: {exc}") from exc


def _chosen(kinds: dict[str, tuple[Path, str]], mla: bool) -> list[tuple[Path, str]] | str:
    """The tensors one layer's scales come from, or what is missing."""
    if mla:  # the record's one scale: k_scale, else the older kv_scale
        for kind in ("k", "kv"):
            if kind in kinds:
                return [kinds[kind]]
        return "an MLA layer needs k_scale or kv_scale (v_scale alone does not scale its record)"
    if "k" in kinds and "v" in kinds:
        return [kinds["k"], kinds["v"]]
    if "kv" in kinds:
        return [kinds["kv"], kinds["kv"]]
    _, name = next(iter(kinds.values()))
    return f"{name} has no partner: an MHA layer needs k_scale and v_scale, or kv_scale"


def _scale_value(file: Path, name: str, problems: list[str]) -> float | None:
    """One per-tensor scale (None, with the reason in `problems`, when it is not one)."""
    with safe_open(str(file), framework="pt") as f:
        shape = f.get_slice(name).get_shape()  # from the header: nothing read yet
        if math.prod(shape) != 1:
            problems.append(f"{name} has shape {list(shape)}: per-head or per-channel KV scales are not "
                            "supported (backends take per-tensor scales: one per MLA layer, a key and a "
                            "value scale per MHA layer)")
            return None
        value = float(f.get_tensor(name).float())
    if not (math.isfinite(value) and value > 0):
        problems.append(f"{name} = {value}: a KV scale must be a finite number > 0")
        return None
    return value


def plan_kv_scales(choice: KVScaleChoice | float, checkpoint: CheckpointKVScales, num_layers: int,
                   mla: bool) -> tuple[KVScalePlan | None, list[str]]:
    """The scales `attention.kv_scale = choice` gives (None with the problems when it cannot)."""
    if not isinstance(choice, str):
        per_layer = (float(choice),) if mla else (float(choice), float(choice))
        return KVScalePlan("config", (per_layer,) * num_layers, f"attention.kv_scale = {choice}"), []
    if choice == "calibrate":
        return _calibration(), []
    usable = bool(checkpoint.layers) and not checkpoint.problems
    if usable:
        names = ", ".join(checkpoint.names)
        layers = tuple(checkpoint.layers[i] for i in range(num_layers))
        return KVScalePlan("checkpoint", layers, f"the checkpoint's {names}"), []
    if checkpoint.problems:
        hint = ' (attention.kv_scale = "calibrate" or a number ignores them)'
        return None, [f"fp8 KV cache scales: {p}{hint}" for p in checkpoint.problems]
    if choice == "checkpoint":
        return None, ['attention.kv_scale = "checkpoint", but the checkpoint has no KV scales (model.layers.'
                      'N.self_attn.k_scale / v_scale / kv_scale): use "calibrate" or a number']
    return _calibration(), []


def _calibration() -> KVScalePlan:
    return KVScalePlan("calibration", None, "calibrated from the first prefill (amax / 448 per layer)")
