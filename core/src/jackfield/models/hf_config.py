"""Hugging Face config -> the facts Jackfield builds a model from. The one place that reads HF fields.

The model is built from the real transformers config object (AutoConfig on a local directory);
this module pulls out what the engine and the layers need, fails closed on what is unsupported,
and computes the RoPE frequencies and the attention softmax scale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoConfig, PretrainedConfig

from jackfield.model_files import ModelFileError, read_config_json

ArchT = TypeVar("ArchT")

# RoPE types whose frequencies do not depend on the sequence length (those we can precompute).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def read_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """AutoConfig on a local directory only: Jackfield never downloads and never runs model code
    (the folder is checked for `auto_map` first, and transformers is told not to trust it)."""
    read_config_json(model_dir)  # a missing file, bad JSON, bad sizes or auto_map: named errors
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    # transformers (and huggingface_hub's strict dataclasses under it) raise assorted exception types
    # for field values they reject; the file is the user's input, so each is reported against it.
    except Exception as exc:
        raise ModelFileError(f"{Path(model_dir) / 'config.json'}: transformers cannot read it: "
                             f"{type(exc).__name__}: {exc}") from exc


def architecture_of(hf_config: PretrainedConfig) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {archs}")
    return archs[0]


def model_type_problems(hf_config: PretrainedConfig, arch: str) -> list[str]:
    """transformers builds the model `model_type` maps to (AutoModelForCausalLM), whatever
    `architectures` says; a family that reads the architecture must see the two agree."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    built = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    if built == arch:
        return []
    return [f"model_type {hf_config.model_type!r} makes transformers build {built or 'no causal LM'}, "
            f"but architectures names {arch}"]


def hf_config_from_dict(data: Mapping[str, object]) -> PretrainedConfig:
    """The transformers config of a config.json's contents, as AutoConfig builds it from the file."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ModelFileError(f"config.json: model_type {model_type!r} is not one transformers knows")
    try:
        return CONFIG_MAPPING[model_type].from_dict(_special_floats(dict(data)))
    except Exception as exc:  # as in read_hf_config: transformers' rejections come in assorted types
        raise ModelFileError(f"config.json: transformers cannot read it: "
                             f"{type(exc).__name__}: {exc}") from exc


# Attention layers beside recurrent ones (Gated DeltaNet, Mamba2): models/qwen3_next.py, granite_hybrid.py.
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM")
HYBRID_MODEL_TYPES = ("qwen3_next", "granitemoehybrid")


def _special_floats(value: object) -> object:
    """transformers writes inf and NaN into config.json as {"__float__": "Infinity"} (Granite 4.0
    hybrid's time_step_limit): the floats again, as AutoConfig reads them."""
    if isinstance(value, dict):
        tag = value.get("__float__") if len(value) == 1 else None
        if tag in ("Infinity", "-Infinity", "NaN"):
            return float(tag.lower().replace("infinity", "inf"))  # type: ignore[union-attr]
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def check_builtin_family(data: Mapping[str, object]) -> None:
    """For an architecture core serves, the translation its model is built from (a ValueError
    naming config.json and each field it refuses), so preflight refuses what loading would."""
    archs = data.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1):
        return
    if archs[0] in DEEPSEEK_ARCHITECTURES:
        deepseek_arch(hf_config_from_dict(data))
    elif archs[0] in GRANITE_ARCHITECTURES:
        granite_arch(hf_config_from_dict(data))
    elif archs[0] == "Qwen3NextForCausalLM":
        from jackfield.models.qwen3_next import qwen3_next_arch  # the family imports this module

        qwen3_next_arch(hf_config_from_dict(data))
    elif archs[0] == "GraniteMoeHybridForCausalLM":
        from jackfield.models.granite_hybrid import granite_hybrid_arch

        granite_hybrid_arch(hf_config_from_dict(data))


def rope_parameters(hf_config: PretrainedConfig) -> dict[str, object]:
    """The RoPE settings (transformers 5 `rope_parameters`, or the older `rope_scaling` + `rope_theta`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_problems(hf_config: PretrainedConfig) -> list[str]:
    """RoPE settings Jackfield does not implement, each naming its config.json field."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return [f"rope_parameters per layer type ({', '.join(params)}): one RoPE setting for all layers only"]
    params = rope_parameters(hf_config)
    problems = []
    if params["rope_type"] not in STATIC_ROPE_TYPES:
        problems.append(f"rope_parameters.rope_type {params['rope_type']!r} "
                        f"(supported: {', '.join(STATIC_ROPE_TYPES)})")
    # transformers' default RoPE rotates the whole head whatever the factor says, and its scaled
    # types return too few frequencies to apply: no reading of a partial factor matches both.
    partial = params.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        problems.append(f"rope_parameters.partial_rotary_factor {partial!r} (only 1: RoPE over the whole "
                        "rotary dimension)")
    return problems


def rope_inv_freq(hf_config: PretrainedConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, cos/sin scaling) for the config's RoPE type."""
    params = rope_parameters(hf_config)
    rope_type = str(params["rope_type"])
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported "
                         f"(supported: {', '.join(STATIC_ROPE_TYPES)})")
    if rope_type == "default":
        base = float(params["rope_theta"])  # type: ignore[arg-type]
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        return (1.0 / base**exponent).float(), 1.0
    # The scaled types: transformers' own frequency formulas (YaRN ramps, llama3 bands).
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if inv_freq.numel() != rotary_dim // 2:
        raise ValueError(f"RoPE produced {inv_freq.numel()} frequencies for rotary dim {rotary_dim}")
    return inv_freq.float(), float(attention_scaling)


def yarn_softmax_scale(hf_config: PretrainedConfig, head_dim: int) -> float:
    """DeepSeek's softmax scale: head_dim**-0.5, times mscale**2 when YaRN sets mscale_all_dim."""
    scale = head_dim**-0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = float(params.get("mscale_all_dim", 0) or 0)  # type: ignore[arg-type]
    factor = float(params.get("factor", 1.0) or 1.0)  # type: ignore[arg-type]
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True)
class DeepseekArch:
    """A DeepSeek-V2/V3 config, translated. `moe_scoring` is V2's softmax or V3's sigmoid."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    first_k_dense_replace: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    moe_scoring: str  # softmax | sigmoid
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope_interleave: bool
    softmax_scale: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_mtp_layers: int  # next-token-prediction layers stored after the main ones (not run)
    # `"is_causal": false` in config.json: bidirectional attention in the expanded (non-MLA) form.
    non_causal: bool = False
    # V3.2's lightning indexer (0: none).
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # V3.2's per-layer "dense" / "sparse" (MoE) list; transformers builds the layers from it when
    # config.json has it (over first_k_dense_replace), and V2/V3 never read it. None: not V3.2.
    mlp_layer_types: tuple[str, ...] | None = None

    def is_moe_layer(self, index: int) -> bool:
        if self.n_routed_experts is None:
            return False
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[index] == "sparse"
        return index >= self.first_k_dense_replace


def _finite(arch_record: ArchT, arch: str) -> ArchT:
    """The record, once every float in it is finite (a NaN scale would only show as NaN logits)."""
    values = {f.name: getattr(arch_record, f.name) for f in dataclasses.fields(arch_record)}  # type: ignore[arg-type]
    bad = [f"{name} {v!r}" for name, v in values.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise ValueError(f"config.json ({arch}): values must be finite: " + "; ".join(bad))
    return arch_record


def _deepseek_routing_problems(c: PretrainedConfig, v3: bool) -> list[str]:
    """Routing fields transformers' model ignores or cannot run, where they would change the
    experts chosen: V2 routes by softmax, greedy or group-limited, unnormalized; V3 by sigmoid
    with noaux_tc groups; every layer from first_k_dense_replace on is MoE. DeepSeek's own code
    reads scoring_func, topk_method, norm_topk_prob and moe_layer_freq, so a config.json that
    sets them otherwise is refused rather than read one way or the other."""
    problems = []
    scoring = "sigmoid" if v3 else "softmax"
    if getattr(c, "scoring_func", scoring) != scoring:
        problems.append(f"scoring_func {c.scoring_func!r} (this architecture routes by {scoring})")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    topk_method = getattr(c, "topk_method", methods[0])
    if v3 and topk_method is None:  # V3 never reads it: a null says nothing
        topk_method = methods[0]
    if topk_method not in methods:
        problems.append(f"topk_method {topk_method!r} (this architecture: {' or '.join(methods)})")
    if getattr(c, "moe_layer_freq", 1) != 1:  # DeepSeek's code makes layers off the stride dense
        problems.append(f"moe_layer_freq {c.moe_layer_freq!r} (transformers' model: every layer from "
                        "first_k_dense_replace on is MoE)")
    if not v3 and getattr(c, "norm_topk_prob", False):
        problems.append("norm_topk_prob=true (transformers' DeepSeek-V2 never renormalizes the top-k "
                        "weights)")
    if topk_method in ("noaux_tc", "group_limited_greedy"):
        n_group, topk_group = getattr(c, "n_group", None), getattr(c, "topk_group", None)
        experts = getattr(c, "n_routed_experts", None)
        if n_group is None or topk_group is None:
            problems.append(f"{topk_method} routing needs n_group and topk_group, "
                            f"got {n_group!r}, {topk_group!r}")
        elif topk_group > n_group:
            problems.append(f"topk_group {topk_group} exceeds n_group {n_group}")
        elif experts is not None and experts % n_group:
            problems.append(f"n_routed_experts {experts} is not divisible by n_group {n_group}")
    return problems


DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
MTP_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # whose MTP layers Jackfield runs


def mtp_layers_problem(data: Mapping[str, object]) -> str | None:
    """Why config.json's checkpoint has no multi-token-prediction layers Jackfield can run
    (`num_nextn_predict_layers` of them, stored as model.layers.{L + i}), or None."""
    archs = data.get("architectures")
    count = data.get("num_nextn_predict_layers") or 0
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in MTP_ARCHITECTURES):
        return f"architectures {archs}: only {' and '.join(MTP_ARCHITECTURES)} checkpoints' MTP layers run"
    if not isinstance(count, int) or count < 1:
        return f"num_nextn_predict_layers is {count!r}: the checkpoint has no multi-token-prediction layers"
    if data.get("is_causal") is False:
        return "is_causal is false: a bidirectional model decodes nothing to draft for"
    return None


def deepseek_arch(hf_config: PretrainedConfig) -> DeepseekArch:
    arch = architecture_of(hf_config)
    v32 = arch == "DeepseekV32ForCausalLM"
    v3 = arch == "DeepseekV3ForCausalLM" or v32  # V3.2 is V3 plus the indexer
    if arch not in DEEPSEEK_ARCHITECTURES:
        raise ValueError(f"{arch} is not a DeepSeek-V2/V3/V3.2 architecture")
    c = hf_config
    problems = model_type_problems(c, arch) + rope_problems(c)
    if getattr(c, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (only 'silu')")
    if getattr(c, "attention_bias", False):
        problems.append("attention_bias=True")
    if getattr(c, "mlp_bias", False):
        problems.append("mlp_bias=True")
    if getattr(c, "quantization_config", None):
        problems.append("quantized checkpoints (quantization_config)")
    problems += _deepseek_routing_problems(c, v3)
    index = (int(c.index_n_heads), int(c.index_head_dim), int(c.index_topk)) if v32 else (0, 0, 0)
    if v32 and min(index) <= 0:
        problems.append(f"index_n_heads, index_head_dim, index_topk must be positive, got {index}")
    if v32 and index[1] < c.qk_rope_head_dim:
        problems.append(f"index_head_dim {index[1]} is smaller than qk_rope_head_dim {c.qk_rope_head_dim}")
    if v32 and c.q_lora_rank is None:
        problems.append("the indexer reads the q latent: q_lora_rank must be set")
    if arch != "DeepseekV3ForCausalLM" and getattr(c, "rope_interleave", True) is False:
        problems.append(f"rope_interleave=false (transformers' {arch} always interleaves its MLA RoPE)")
    # transformers' V3.2 config fills mlp_layer_types from first_k_dense_replace when it is absent.
    mlp_layer_types = tuple(getattr(c, "mlp_layer_types", None) or ()) if v32 else None
    if v32 and (len(mlp_layer_types or ()) != c.num_hidden_layers
                or not set(mlp_layer_types or ()) <= {"dense", "sparse"}):
        problems.append(f"mlp_layer_types must list 'dense' or 'sparse' for each of the "
                        f"{c.num_hidden_layers} layers, got {list(mlp_layer_types or ())}")
    non_causal = getattr(c, "is_causal", True) is False
    if non_causal and v32:
        problems.append("is_causal=false with the sparse indexer")
    if problems:
        raise ValueError(f"config.json ({arch}): unsupported settings: " + "; ".join(problems))
    topk_method = "noaux_tc" if v3 else str(c.topk_method)
    qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    n_group = int(getattr(c, "n_group", None) or 1)  # unread by V2's greedy routing
    return _finite(DeepseekArch(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rms_norm_eps=float(c.rms_norm_eps),
        first_k_dense_replace=int(getattr(c, "first_k_dense_replace", 0) or 0),
        n_routed_experts=getattr(c, "n_routed_experts", None),
        n_shared_experts=int(getattr(c, "n_shared_experts", 0) or 0),
        num_experts_per_tok=int(getattr(c, "num_experts_per_tok", 0) or 0),
        n_group=n_group,
        topk_group=int(getattr(c, "topk_group", None) or n_group),
        topk_method=topk_method,
        moe_scoring="sigmoid" if v3 else "softmax",
        # V2 never renormalizes the top-k weights (a true flag is refused above); V3 follows it.
        norm_topk_prob=bool(getattr(c, "norm_topk_prob", False)) and v3,
        routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0)),
        # V2's and V3.2's MLA RoPE is always interleaved (their configs have no rope_interleave).
        rope_interleave=bool(getattr(c, "rope_interleave", True)) if v3 and not v32 else True,
        softmax_scale=yarn_softmax_scale(c, qk_head_dim),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        max_position_embeddings=int(c.max_position_embeddings),
        num_mtp_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0),
        non_causal=non_causal,
        index_n_heads=index[0],
        index_head_dim=index[1],
        index_topk=index[2],
        mlp_layer_types=mlp_layer_types,
    ), arch)


# --- Llama / Granite / Granite SWA / Granite MoE -------------------------------------------------

SINK_MODEL_TYPES = ("granite_swa", "granitemoe_swa")  # sinks are part of these architectures (no flag)
# transformers' models of these types read neither layer_types nor sliding_window: every layer is full.
FULL_ATTENTION_MODEL_TYPES = ("llama", "granite", "granitemoe", "granitemoeshared")
GRANITE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "GraniteForCausalLM",
    "GraniteSWAForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GraniteMoeSWAForCausalLM",
)


@dataclass(frozen=True)
class LayerAttention:
    """Per-layer attention pattern: sliding windows (tokens a query sees, itself included; None =
    full attention) and whether the layers carry per-head sink logits."""

    windows: tuple[int | None, ...]
    sinks: bool

    @property
    def sliding_window(self) -> bool:
        return any(w is not None for w in self.windows)


def layer_attention(cfg: Mapping[str, object]) -> LayerAttention:
    """Windows and sinks from a config.json dict (or `PretrainedConfig.to_dict()`).

    `layer_types` ("full_attention" / "sliding_attention") and `sliding_window` decide the windows.
    Without `layer_types`: the Granite SWA default (layer i is full when i % 4 == 0) for the SWA
    families, every layer sliding when only `sliding_window` is set (Mistral), else every layer
    full. Llama and Granite (MoE) models are full attention in transformers whatever the two
    fields say: a window they would ignore but that bites is refused, not guessed at.
    """
    model_type = cfg.get("model_type")
    num_layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if model_type in HYBRID_MODEL_TYPES:  # full attention beside recurrent layers (the family checks types)
        return LayerAttention(windows=(None,) * num_layers, sinks=False)
    if model_type in FULL_ATTENTION_MODEL_TYPES:
        problems = unread_window_problems(cfg)
        if problems:
            raise ValueError("config.json: " + "; ".join(problems))
        return LayerAttention(windows=(None,) * num_layers, sinks=False)
    if types is None:
        if model_type in SINK_MODEL_TYPES:
            types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention" if window else "full_attention"] * num_layers
    types = list(types)  # type: ignore[call-overload]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (full_attention, sliding_attention)")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_attention layers need a positive integer sliding_window, got {window!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)  # type: ignore[misc]
    return LayerAttention(windows=windows, sinks=model_type in SINK_MODEL_TYPES)


def unread_window_problems(cfg: Mapping[str, object]) -> list[str]:
    """For a full-attention model type, the sliding windows its config.json asks for (a window
    shorter than the context, or sliding layer_types) that transformers never applies."""
    model_type = cfg.get("model_type")
    if model_type not in FULL_ATTENTION_MODEL_TYPES:
        return []
    window, types = cfg.get("sliding_window"), cfg.get("layer_types")
    limit = cfg.get("max_position_embeddings")
    asks = []
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        asks.append(f"layer_types {sorted(set(map(str, types)))}")
    if window is not None and not (isinstance(window, int) and isinstance(limit, int) and window >= limit):
        asks.append(f"sliding_window {window!r}")
    if not asks:
        return []
    return [f"{' and '.join(asks)} (transformers' {model_type} model never applies sliding windows: every "
            "layer attends to the whole context; remove the field, or serve the checkpoint as a model "
            "type with sliding windows, granite_swa)"]


@dataclass(frozen=True)
class GraniteArch:
    """A Llama / Granite (SWA, MoE) config, translated. Llama is Granite with unit multipliers."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's, or each routed expert's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_scale: float
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    windows: tuple[int | None, ...]
    sinks: bool
    rope_thetas: tuple[float, ...]  # per layer; 0 = no positional embedding
    num_experts: int  # 0: dense MLP
    num_experts_per_tok: int
    shared_intermediate_size: int  # 0: no shared expert


SWA_ARCHITECTURES = ("GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM")
SHARED_EXPERT_ARCHITECTURES = ("GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM")
GRANITE_MULTIPLIER_FIELDS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def _granite_unread_field_problems(c: PretrainedConfig, arch: str, head_dim: int) -> list[str]:
    """Fields of a sibling architecture that `arch`'s transformers model never reads, set to a value
    that would change the outputs had it been read (by the sibling, or the checkpoint's author):
    refused, since either reading would be a guess."""
    problems = model_type_problems(c, arch) + rope_problems(c) + unread_window_problems(c.to_dict())
    if arch == "LlamaForCausalLM":
        problems += [f"{name} {getattr(c, name)!r} (Llama has no Granite multipliers)"
                     for name in GRANITE_MULTIPLIER_FIELDS if getattr(c, name, 1) not in (None, 1)]
        attention_multiplier = getattr(c, "attention_multiplier", None)
        if attention_multiplier is not None and attention_multiplier != head_dim**-0.5:
            problems.append(f"attention_multiplier {attention_multiplier!r} (Llama scales by head_dim**-0.5)")
    if arch not in SWA_ARCHITECTURES:
        theta = rope_parameters(c)["rope_theta"]
        layer_thetas = getattr(c, "layer_rope_theta", None)
        if layer_thetas is not None and any(t != theta for t in layer_thetas):
            problems.append(f"layer_rope_theta (transformers' {arch} uses rope_theta {theta} in every layer)")
    if arch not in SHARED_EXPERT_ARCHITECTURES and getattr(c, "shared_intermediate_size", None):
        problems.append(f"shared_intermediate_size {c.shared_intermediate_size} "
                        f"(transformers' {arch} has no shared expert)")
    sinks = c.model_type in SINK_MODEL_TYPES
    for flag in ("attention_sinks", "use_sinks"):
        if getattr(c, flag, None) is not None and bool(getattr(c, flag)) != sinks:
            problems.append(f"{flag}={getattr(c, flag)!r} (transformers' {arch} "
                            f"{'always has' if sinks else 'has no'} attention sinks)")
    return problems


def granite_arch(hf_config: PretrainedConfig) -> GraniteArch:
    arch = architecture_of(hf_config)
    if arch not in GRANITE_ARCHITECTURES:
        raise ValueError(f"{arch} is not one of {', '.join(GRANITE_ARCHITECTURES)}")
    c = hf_config
    problems = []
    if getattr(c, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(c, flag, False):
            problems.append(f"{flag}=True")
    if getattr(c, "quantization_config", None):
        problems.append("quantized checkpoints (quantization_config)")
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    problems += _granite_unread_field_problems(c, arch, head_dim)
    if "Moe" in arch and not getattr(c, "num_local_experts", 1):
        problems.append(f"num_local_experts 0 ({arch} routes every token to experts)")
    if problems:
        raise ValueError(f"config.json ({arch}): unsupported settings: " + "; ".join(problems))
    pattern = layer_attention(c.to_dict())
    granite = arch != "LlamaForCausalLM"
    theta = float(rope_parameters(c)["rope_theta"])  # type: ignore[arg-type]
    thetas = (getattr(c, "layer_rope_theta", None) if arch in SWA_ARCHITECTURES else None) or (
        [theta] * c.num_hidden_layers)
    if len(thetas) != c.num_hidden_layers:
        raise ValueError(f"layer_rope_theta has {len(thetas)} entries for {c.num_hidden_layers} layers")
    moe = "Moe" in arch
    return _finite(GraniteArch(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=int(c.num_key_value_heads or c.num_attention_heads),
        head_dim=head_dim,
        rms_norm_eps=float(c.rms_norm_eps),
        attention_scale=float(c.attention_multiplier) if granite else head_dim**-0.5,
        embedding_multiplier=float(c.embedding_multiplier) if granite else 1.0,
        residual_multiplier=float(c.residual_multiplier) if granite else 1.0,
        logits_scaling=float(c.logits_scaling) if granite else 1.0,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        max_position_embeddings=int(c.max_position_embeddings),
        windows=pattern.windows,
        sinks=pattern.sinks,
        rope_thetas=tuple(float(t) for t in thetas),
        num_experts=int(c.num_local_experts) if moe else 0,
        num_experts_per_tok=int(c.num_experts_per_tok) if moe else 0,
        shared_intermediate_size=(int(getattr(c, "shared_intermediate_size", 0) or 0)
                                  if arch in SHARED_EXPERT_ARCHITECTURES else 0),
    ), arch)
