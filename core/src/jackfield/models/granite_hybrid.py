"""Granite 4.0 hybrid (GraniteMoeHybrid): Mamba2 layers beside GQA attention, Granite's
multipliers, a top-k MoE (softmax over the chosen logits) plus a shared MLP, or the shared MLP
alone when num_local_experts is 0. RoPE when position_embedding_type is "rope", else none.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.model import ModelCapabilities
from jackfield.contracts.recurrent import RecurrentStateSpec
from jackfield.models.attention import RoleImpls
from jackfield.models.hf_config import architecture_of, model_type_problems, rope_inv_freq, rope_problems
from jackfield.models.hybrid import (
    RECURRENT_LAYER_TYPE,
    HybridDecoderStack,
    layer_indices,
    layer_type_problems,
    refuse_unsupported,
)
from jackfield.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, select_rows
from jackfield.models.moe import Experts, grouped_mm_supported
from jackfield.models.recurrent_layers import Mamba2Mixer
from jackfield.models.weights import Rule, WeightMapper, iter_checkpoint, load_weights

_LAYER = r"(?P<layer>model\.layers\.\d+)"
_MOE = _LAYER + r"\.block_sparse_moe"
GRANITE_HYBRID_WEIGHTS = WeightMapper(
    rules=(
        Rule(_LAYER + r"\.shared_mlp\.input_linear\.weight", "{layer}.shared_mlp.gate_up_proj.weight"),
        Rule(_LAYER + r"\.shared_mlp\.output_linear\.weight", "{layer}.shared_mlp.down_proj.weight"),
        Rule(_MOE + r"\.experts\.gate_up_proj", "{layer}.block_sparse_moe.experts.w13"),
        Rule(_MOE + r"\.experts\.down_proj", "{layer}.block_sparse_moe.experts.w2"),
        # older names (the published checkpoints)
        Rule(_MOE + r"\.input_linear\.weight", "{layer}.block_sparse_moe.experts.w13"),
        Rule(_MOE + r"\.output_linear\.weight", "{layer}.block_sparse_moe.experts.w2"),
        Rule(_MOE + r"\.router\.layer\.weight", "{layer}.block_sparse_moe.router.weight"),
        Rule(r"(?P<name>.+)", "{name}"),
    ),
)


@dataclass(frozen=True)
class GraniteHybridArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
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
    rope: bool
    num_experts: int  # 0: the shared MLP only
    num_experts_per_tok: int
    intermediate_size: int  # each routed expert's
    shared_intermediate_size: int
    mamba_heads: int
    mamba_head_dim: int
    mamba_groups: int
    mamba_state: int
    mamba_conv_kernel: int
    mamba_conv_bias: bool
    dt_limit: tuple[float, float]


def granite_hybrid_arch(c: PretrainedConfig) -> GraniteHybridArch:
    """The config translated; every setting Jackfield does not run is refused at once."""
    arch = architecture_of(c)
    problems = model_type_problems(c, arch) + layer_type_problems(c.layer_types, c.num_hidden_layers)
    if c.hidden_act != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (only 'silu')")
    for flag in ("attention_bias", "mamba_proj_bias"):
        if getattr(c, flag, False):
            problems.append(f"{flag}=True")
    if getattr(c, "quantization_config", None):
        problems.append("quantized checkpoints (quantization_config)")
    if c.position_embedding_type not in (None, "rope"):
        problems.append(f"position_embedding_type {c.position_embedding_type!r} (rope or none)")
    if c.position_embedding_type == "rope":
        problems += rope_problems(c)
    if c.mamba_n_heads % c.mamba_n_groups:
        problems.append(f"mamba_n_heads {c.mamba_n_heads} is not a multiple of mamba_n_groups "
                        f"{c.mamba_n_groups}")
    refuse_unsupported(problems, arch)
    limit = c.time_step_limit or (0.0, math.inf)
    head_dim = c.hidden_size // c.num_attention_heads
    return GraniteHybridArch(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        layer_types=tuple(c.layer_types), num_heads=c.num_attention_heads,
        num_kv_heads=int(c.num_key_value_heads or c.num_attention_heads), head_dim=head_dim,
        rms_norm_eps=float(c.rms_norm_eps), attention_scale=float(c.attention_multiplier),
        embedding_multiplier=float(c.embedding_multiplier), residual_multiplier=float(c.residual_multiplier),
        logits_scaling=float(c.logits_scaling), tie_word_embeddings=bool(c.tie_word_embeddings),
        max_position_embeddings=c.max_position_embeddings, rope=c.position_embedding_type == "rope",
        num_experts=int(c.num_local_experts or 0), num_experts_per_tok=int(c.num_experts_per_tok or 0),
        intermediate_size=c.intermediate_size, shared_intermediate_size=c.shared_intermediate_size,
        mamba_heads=c.mamba_n_heads, mamba_head_dim=int(c.mamba_d_head), mamba_groups=c.mamba_n_groups,
        mamba_state=c.mamba_d_state, mamba_conv_kernel=c.mamba_d_conv,
        mamba_conv_bias=bool(c.mamba_conv_bias),
        dt_limit=(float(limit[0]), float(limit[1])))


class Attention(nn.Module):
    def __init__(self, a: GraniteHybridArch, cache_index: int, spec: AttentionLayerSpec,
                 backends: AttentionBackends, rope: RotaryEmbedding | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.a, self.cache_index, self.rope = a, cache_index, [rope]  # a list: the table is the model's
        self.q_proj = Linear(a.hidden_size, a.num_heads * a.head_dim, dtype)
        self.k_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, dtype)
        self.v_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, dtype)
        self.o_proj = Linear(a.num_heads * a.head_dim, a.hidden_size, dtype)
        self.attn = RoleImpls(backends, spec)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, t, rope = self.a, x.shape[0], self.rope[0]
        q = self.q_proj(x).view(t, a.num_heads, a.head_dim)
        k = self.k_proj(x).view(t, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(t, a.num_kv_heads, a.head_dim)
        if rope is not None:
            q, k = rope(q, positions), rope(k, positions)
        return q, k, v


class MoE(nn.Module):
    """Top-k routing with the softmax over the k chosen logits."""

    def __init__(self, a: GraniteHybridArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = a.num_experts_per_tok
        self.router = Linear(a.hidden_size, a.num_experts, dtype)
        self.experts = Experts(a.num_experts, a.hidden_size, a.intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, ids = self.router(x).float().topk(self.top_k, dim=-1)
        return self.experts(x, top_logits.softmax(dim=-1).to(x.dtype), ids)


class DecoderLayer(nn.Module):
    def __init__(self, a: GraniteHybridArch, i: int, index: int, spec: AttentionLayerSpec,
                 backends: AttentionBackends, rope: RotaryEmbedding | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.index, self.residual_multiplier = index, a.residual_multiplier
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.recurrent = a.layer_types[i] == RECURRENT_LAYER_TYPE
        if self.recurrent:
            self.mamba = Mamba2Mixer(a.hidden_size, a.mamba_heads, a.mamba_head_dim, a.mamba_groups,
                                     a.mamba_state, a.mamba_conv_kernel, a.mamba_conv_bias, a.dt_limit,
                                     a.rms_norm_eps, dtype)
        else:
            self.self_attn = Attention(a, index, spec, backends, rope, dtype)
        self.block_sparse_moe = MoE(a, dtype) if a.num_experts else None
        self.shared_mlp = GatedMLP(a.hidden_size, a.shared_intermediate_size, dtype)

    def before_attention(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.input_layernorm(x)
        return self.mamba.project(h) if self.recurrent else self.self_attn.project(h, positions)

    def attend(self, step: StepContext, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.recurrent:
            assert step.recurrent is not None, "a hybrid model's step carries its recurrent metadata"
            return self.mamba.mix(step.recurrent, self.index, *inputs)
        return self.self_attn.attn.run(step, self.index, *inputs)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if self.recurrent:
            mixed = self.mamba.output(out, rows)
        else:
            out = select_rows(out, rows)
            mixed = self.self_attn.o_proj(out.reshape(out.shape[0], -1))
        x = select_rows(x, rows) + mixed * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        mlp = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(h) + mlp
        return x + mlp * self.residual_multiplier


class GraniteMoeHybridForCausalLM(HybridDecoderStack):
    def __init__(self, hf_config: PretrainedConfig, backends: AttentionBackends, dtype: torch.dtype,
                 kv_cache_dtype: KVCacheDType = "auto") -> None:
        super().__init__()
        a = self.arch = granite_hybrid_arch(hf_config)
        self.dtype = dtype
        spec = AttentionLayerSpec(num_heads=a.num_heads, head_size=a.head_dim, scale=a.attention_scale,
                                  num_kv_heads=a.num_kv_heads, kv_cache_dtype=kv_cache_dtype)
        self.rope = None
        if a.rope:
            inv_freq, scaling = rope_inv_freq(hf_config, a.head_dim)
            self.rope = RotaryEmbedding(inv_freq, scaling, a.max_position_embeddings, interleaved=False)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(torch.empty(a.vocab_size, a.hidden_size, dtype=dtype),
                                                      False)
        self.model.layers = nn.ModuleList(
            DecoderLayer(a, i, index, spec, backends, self.rope, dtype)
            for i, index in enumerate(layer_indices(a.layer_types)))
        self.model.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        if not a.tie_word_embeddings:
            self.lm_head = Linear(a.hidden_size, a.vocab_size, dtype)
        self._kv_layers = [spec] * sum(not layer.recurrent for layer in self.model.layers)
        self._states = [layer.mamba.state_spec() for layer in self.model.layers if layer.recurrent]

    @property
    def kv_cache_layers(self) -> list[AttentionLayerSpec]:
        return list(self._kv_layers)

    @property
    def recurrent_state_layers(self) -> list[RecurrentStateSpec]:
        return list(self._states)

    @functools.cached_property
    def capabilities(self) -> ModelCapabilities:
        a = self.arch
        # Recordable unless MoE experts loop (they read group sizes on the host); the recurrent
        # layers read their metadata from the device only.
        device = self.model.embed_tokens.weight.device
        graph_safe = not a.num_experts or grouped_mm_supported(device, self.dtype)
        return ModelCapabilities(vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.num_layers,
                                 max_model_len=a.max_position_embeddings, dtype=self.dtype,
                                 cuda_graph_safe=graph_safe)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: PretrainedConfig, backends: AttentionBackends,
                        dtype: torch.dtype, device: torch.device | str,
                        kv_cache_dtype: KVCacheDType = "auto") -> GraniteMoeHybridForCausalLM:
        with torch.device(device):
            model = cls(hf_config, backends, dtype, kv_cache_dtype)
        mapper = GRANITE_HYBRID_WEIGHTS
        if model.arch.tie_word_embeddings:
            mapper = WeightMapper(mapper.rules, (*mapper.ignore, r"lm_head\.weight"))
        load_weights(dict(model.named_parameters()), iter_checkpoint(model_dir), mapper)
        return model.eval()

    @property
    def attention_output_shape(self) -> tuple[int, ...]:
        return self.arch.num_heads, self.arch.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.model.embed_tokens.weight) * self.arch.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float() / self.arch.logits_scaling
