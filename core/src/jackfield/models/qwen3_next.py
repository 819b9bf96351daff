"""Qwen3-Next: Gated DeltaNet layers beside gated full attention, a sparse MoE with a gated
shared expert.

Full attention: q_proj gives, per head, [query ‖ gate]; queries and keys get an RMSNorm
(Gemma's: scaled by 1 + weight) and RoPE over the first `partial_rotary_factor` of each head;
the output is multiplied by sigmoid(gate) before o_proj. The MoE routes by softmax over every
expert, keeps the top k (renormalized when norm_topk_prob) and adds the shared expert scaled by
sigmoid(shared_expert_gate(x)). The checkpoint's MTP layers (`mtp.*`) are not run.
"""

from __future__ import annotations

import functools
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
from jackfield.models.hf_config import architecture_of, model_type_problems, rope_inv_freq, rope_parameters
from jackfield.models.hybrid import (
    RECURRENT_LAYER_TYPE,
    HybridDecoderStack,
    layer_indices,
    layer_type_problems,
    refuse_unsupported,
)
from jackfield.models.layers import GatedMLP, Linear, RotaryEmbedding, select_rows
from jackfield.models.moe import Experts, grouped_mm_supported
from jackfield.models.recurrent_layers import GatedDeltaNet
from jackfield.models.weights import Rule, WeightMapper, iter_checkpoint, load_weights

_LAYER = r"(?P<layer>model\.layers\.\d+)"
_SHARED = _LAYER + r"\.mlp\.shared_expert"
_EXPERT = _LAYER + r"\.mlp\.experts\.(?P<e>\d+)"
QWEN3_NEXT_WEIGHTS = WeightMapper(
    rules=(
        Rule(_LAYER + r"\.mlp\.gate_proj\.weight", "{layer}.mlp.gate_up_proj.weight", shard=(0, 2)),
        Rule(_LAYER + r"\.mlp\.up_proj\.weight", "{layer}.mlp.gate_up_proj.weight", shard=(1, 2)),
        Rule(_SHARED + r"\.gate_proj\.weight", "{layer}.mlp.shared_expert.gate_up_proj.weight", shard=(0, 2)),
        Rule(_SHARED + r"\.up_proj\.weight", "{layer}.mlp.shared_expert.gate_up_proj.weight", shard=(1, 2)),
        Rule(_LAYER + r"\.mlp\.experts\.gate_up_proj", "{layer}.mlp.experts.w13"),
        Rule(_LAYER + r"\.mlp\.experts\.down_proj", "{layer}.mlp.experts.w2"),
        # the published checkpoints store each expert apart
        Rule(_EXPERT + r"\.gate_proj\.weight", "{layer}.mlp.experts.w13", (0, 2), "e"),
        Rule(_EXPERT + r"\.up_proj\.weight", "{layer}.mlp.experts.w13", (1, 2), "e"),
        Rule(_EXPERT + r"\.down_proj\.weight", "{layer}.mlp.experts.w2", None, "e"),
        Rule(r"(?P<name>.+)", "{name}"),
    ),
    ignore=(r"mtp\..*",),
)


@dataclass(frozen=True)
class Qwen3NextArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    intermediate_size: int  # dense MLP layers
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int


def qwen3_next_arch(c: PretrainedConfig) -> Qwen3NextArch:
    """The config translated; every setting Jackfield does not run is refused at once."""
    arch = architecture_of(c)
    problems = model_type_problems(c, arch) + layer_type_problems(c.layer_types, c.num_hidden_layers)
    if c.hidden_act != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (only 'silu')")
    if getattr(c, "attention_bias", False):
        problems.append("attention_bias=True")
    if getattr(c, "quantization_config", None):
        problems.append("quantized checkpoints (quantization_config)")
    rope = rope_parameters(c)
    if rope["rope_type"] != "default":
        problems.append(f"rope_parameters.rope_type {rope['rope_type']!r} (only 'default', with a partial "
                        "rotary factor)")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        problems.append(f"linear_num_value_heads {c.linear_num_value_heads} is not a multiple of "
                        f"linear_num_key_heads {c.linear_num_key_heads}")
    refuse_unsupported(problems, arch)
    head_dim = int(c.head_dim or c.hidden_size // c.num_attention_heads)
    moe = tuple(i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
                for i in range(c.num_hidden_layers))
    return Qwen3NextArch(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        layer_types=tuple(c.layer_types), num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=head_dim,
        rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", 1.0))),  # type: ignore[arg-type]
        rms_norm_eps=float(c.rms_norm_eps), max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(c.tie_word_embeddings), intermediate_size=c.intermediate_size,
        moe_layers=moe,
        num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        norm_topk_prob=bool(c.norm_topk_prob),
        linear_num_key_heads=c.linear_num_key_heads, linear_num_value_heads=c.linear_num_value_heads,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), in float32, rounded once (Qwen3-Next's, Gemma's)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, a: Qwen3NextArch, cache_index: int, spec: AttentionLayerSpec,
                 backends: AttentionBackends, rope: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.a, self.cache_index, self.rope = a, cache_index, [rope]  # a list: the table is the model's
        self.q_proj = Linear(a.hidden_size, 2 * a.num_heads * a.head_dim, dtype)
        self.k_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, dtype)
        self.v_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, dtype)
        self.o_proj = Linear(a.num_heads * a.head_dim, a.hidden_size, dtype)
        self.q_norm = OffsetRMSNorm(a.head_dim, a.rms_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(a.head_dim, a.rms_norm_eps, dtype)
        self.attn = RoleImpls(backends, spec)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        r = self.a.rotary_dim
        return torch.cat([self.rope[0](x[..., :r], positions), x[..., r:]], dim=-1)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, t = self.a, x.shape[0]
        q, gate = self.q_proj(x).view(t, a.num_heads, 2 * a.head_dim).chunk(2, dim=-1)
        k = self.k_norm(self.k_proj(x).view(t, a.num_kv_heads, a.head_dim))
        v = self.v_proj(x).view(t, a.num_kv_heads, a.head_dim)
        return self._rope(self.q_norm(q), positions), self._rope(k, positions), v, gate.reshape(t, -1)

    def attend(self, step: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               gate: torch.Tensor) -> torch.Tensor:
        out = self.attn.run(step, self.cache_index, q.contiguous(), k.contiguous(), v)
        return out.reshape(out.shape[0], -1) * torch.sigmoid(gate)


class SparseMoE(nn.Module):
    def __init__(self, a: Qwen3NextArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, a.norm_topk_prob
        self.gate = Linear(a.hidden_size, a.num_experts, dtype)
        self.experts = Experts(a.num_experts, a.hidden_size, a.moe_intermediate_size, dtype)
        self.shared_expert = GatedMLP(a.hidden_size, a.shared_expert_intermediate_size, dtype)
        self.shared_expert_gate = Linear(a.hidden_size, 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x).float().softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights.to(x.dtype), ids) + shared


class DecoderLayer(nn.Module):
    def __init__(self, a: Qwen3NextArch, i: int, index: int, spec: AttentionLayerSpec,
                 backends: AttentionBackends, rope: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = index  # among the layers of its type: its KV cache, or its recurrent state
        self.input_layernorm = OffsetRMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.recurrent = a.layer_types[i] == RECURRENT_LAYER_TYPE
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(a.hidden_size, a.linear_num_key_heads, a.linear_num_value_heads,
                                             a.linear_key_head_dim, a.linear_value_head_dim,
                                             a.linear_conv_kernel_dim, a.rms_norm_eps, dtype)
        else:
            self.self_attn = GatedAttention(a, index, spec, backends, rope, dtype)
        self.mlp = (SparseMoE(a, dtype) if a.moe_layers[i]
                    else GatedMLP(a.hidden_size, a.intermediate_size, dtype))

    def before_attention(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.input_layernorm(x)
        return self.linear_attn.project(h) if self.recurrent else self.self_attn.project(h, positions)

    def attend(self, step: StepContext, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.recurrent:
            assert step.recurrent is not None, "a hybrid model's step carries its recurrent metadata"
            return self.linear_attn.mix(step.recurrent, self.index, *inputs)
        return self.self_attn.attend(step, *inputs)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        mixed = (self.linear_attn.output(out, rows) if self.recurrent
                 else self.self_attn.o_proj(select_rows(out, rows)))
        x = select_rows(x, rows) + mixed
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextForCausalLM(HybridDecoderStack):
    def __init__(self, hf_config: PretrainedConfig, backends: AttentionBackends, dtype: torch.dtype,
                 kv_cache_dtype: KVCacheDType = "auto") -> None:
        super().__init__()
        a = self.arch = qwen3_next_arch(hf_config)
        self.dtype = dtype
        spec = AttentionLayerSpec(num_heads=a.num_heads, head_size=a.head_dim, scale=a.head_dim**-0.5,
                                  num_kv_heads=a.num_kv_heads, kv_cache_dtype=kv_cache_dtype)
        inv_freq, scaling = rope_inv_freq(hf_config, a.rotary_dim)
        self.rope = RotaryEmbedding(inv_freq, scaling, a.max_position_embeddings, interleaved=False)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(torch.empty(a.vocab_size, a.hidden_size, dtype=dtype),
                                                      False)
        self.model.layers = nn.ModuleList(
            DecoderLayer(a, i, index, spec, backends, self.rope, dtype)
            for i, index in enumerate(layer_indices(a.layer_types)))
        self.model.norm = OffsetRMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        if not a.tie_word_embeddings:
            self.lm_head = Linear(a.hidden_size, a.vocab_size, dtype)
        self._kv_layers = [spec] * sum(not layer.recurrent for layer in self.model.layers)
        self._states = [layer.linear_attn.state_spec() for layer in self.model.layers if layer.recurrent]

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
        graph_safe = not any(a.moe_layers) or grouped_mm_supported(device, self.dtype)
        return ModelCapabilities(vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.num_layers,
                                 max_model_len=a.max_position_embeddings, dtype=self.dtype,
                                 cuda_graph_safe=graph_safe)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: PretrainedConfig, backends: AttentionBackends,
                        dtype: torch.dtype, device: torch.device | str,
                        kv_cache_dtype: KVCacheDType = "auto") -> Qwen3NextForCausalLM:
        with torch.device(device):
            model = cls(hf_config, backends, dtype, kv_cache_dtype)
        mapper = QWEN3_NEXT_WEIGHTS
        if model.arch.tie_word_embeddings:
            mapper = WeightMapper(mapper.rules, (*mapper.ignore, r"lm_head\.weight"))
        load_weights(dict(model.named_parameters()), iter_checkpoint(model_dir), mapper)
        return model.eval()

    @property
    def attention_output_shape(self) -> tuple[int, ...]:
        return (self.arch.num_heads * self.arch.head_dim,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.model.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()
