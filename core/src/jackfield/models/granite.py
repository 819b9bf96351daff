"""Llama, Granite, Granite SWA and the Granite MoE variants: one GQA decoder, one code path.

The families differ only in data read by `granite_arch`: Granite's four multipliers (Llama: 1,
and the usual head_dim**-0.5 attention scale), per-layer sliding windows and attention sinks
(SWA variants), per-layer RoPE bases (0 = no positional embedding), and a dense MLP or a top-k
MoE with an optional shared expert. Parameter names follow the checkpoint except where weights
are fused (q ‖ k ‖ v, gate ‖ up: one matmul each, which a CPU decode step reads at a better rate
than three small ones) or stacked (experts); GRANITE_WEIGHTS maps both the older GraniteMoe names
(input_linear / output_linear / router.layer) and the newer ones (experts.gate_up_proj / ...).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.model import ModelCapabilities
from jackfield.distributed.cp_common import parallel_state
from jackfield.distributed.tensor_parallel import (
    all_reduce,
    embed,
    gather_logits,
    head_split,
    local_size,
    part,
)
from jackfield.models.attention import RoleImpls
from jackfield.models.hf_config import GraniteArch, granite_arch, rope_inv_freq
from jackfield.models.layers import (
    HEAD_PACKED_MIN_ROWS,
    DecoderStack,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    scaled,
    select_rows,
)
from jackfield.models.moe import Experts, grouped_mm_supported
from jackfield.models.weights import (
    Rule,
    ShardPlan,
    Split,
    WeightMapper,
    iter_checkpoint,
    iter_checkpoint_slices,
    load_weights,
)

_LAYER = r"(?P<layer>model\.layers\.\d+)"
_MOE = _LAYER + r"\.block_sparse_moe"

GRANITE_WEIGHTS = WeightMapper(
    rules=(
        Rule(_LAYER + r"\.mlp\.gate_proj\.weight", "{layer}.mlp.gate_up_proj.weight", shard=(0, 2)),
        Rule(_LAYER + r"\.mlp\.up_proj\.weight", "{layer}.mlp.gate_up_proj.weight", shard=(1, 2)),
        Rule(_LAYER + r"\.shared_mlp\.input_linear\.weight", "{layer}.shared_mlp.gate_up_proj.weight"),
        Rule(_LAYER + r"\.shared_mlp\.output_linear\.weight", "{layer}.shared_mlp.down_proj.weight"),
        # newer names (transformers >= 5)
        Rule(_MOE + r"\.experts\.gate_up_proj", "{layer}.block_sparse_moe.experts.w13"),
        Rule(_MOE + r"\.experts\.down_proj", "{layer}.block_sparse_moe.experts.w2"),
        # older names (the published GraniteMoe checkpoints)
        Rule(_MOE + r"\.input_linear\.weight", "{layer}.block_sparse_moe.experts.w13"),
        Rule(_MOE + r"\.output_linear\.weight", "{layer}.block_sparse_moe.experts.w2"),
        Rule(_MOE + r"\.router\.layer\.weight", "{layer}.block_sparse_moe.router.weight"),
        Rule(r"(?P<name>.+)", "{name}"),
    ),
    ignore=(r".*\.rotary_embs?(?:\.\d+)?\.inv_freq",),
)


def granite_weight_mapper(arch: GraniteArch) -> WeightMapper:
    """GRANITE_WEIGHTS after the rules that fuse q, k and v into qkv_proj (its rows sized by this
    rank's query and KV heads), also skipping a tied lm_head (some checkpoints store it anyway)."""
    heads = head_split(arch.num_heads, arch.num_kv_heads)
    sizes = (heads.num_heads, heads.num_kv_heads, heads.num_kv_heads)
    qkv = tuple(Rule(_LAYER + rf"\.self_attn\.{name}_proj\.weight", "{layer}.self_attn.qkv_proj.weight",
                     shard=(i, 3), sizes=sizes) for i, name in enumerate("qkv"))
    ignore = GRANITE_WEIGHTS.ignore + ((r"lm_head\.weight",) if arch.tie_word_embeddings else ())
    return WeightMapper((*qkv, *GRANITE_WEIGHTS.rules), ignore)


def granite_shard_plan(arch: GraniteArch) -> ShardPlan:
    """This rank's part of each parameter (docs/parallelism.md): query heads, MLP columns and
    vocabulary rows split over every rank, KV heads over the head groups, experts whole."""
    tp = parallel_state()
    rank, size = tp.tp_rank, tp.tp_size
    kv = head_split(arch.num_heads, arch.num_kv_heads)
    column, row, kv_heads = Split(0, rank, size), Split(1, rank, size), Split(0, kv.kv_index, kv.kv_parts)
    layer = r"model\.layers\.\d+\."
    return ShardPlan(splits=(
        (layer + r"self_attn\.qkv_proj\.weight", (column, kv_heads, kv_heads)),  # q, k, v
        (layer + r"self_attn\.sinks", column),
        (layer + r"self_attn\.o_proj\.weight", row),
        (layer + r"mlp\.gate_up_proj\.weight", column),  # gate and up arrive as two tensors
        (layer + r"shared_mlp\.gate_up_proj\.weight", Split(0, rank, size, fused=2)),  # one tensor
        (layer + r"(?:shared_mlp|mlp)\.down_proj\.weight", row),
        (layer + r"block_sparse_moe\.experts\.w(?:13|2)", column),  # stacked experts: whole ones
        (r"model\.embed_tokens\.weight|lm_head\.weight", column),
    ))


class GQAAttention(nn.Module):
    def __init__(
        self,
        arch: GraniteArch,
        index: int,
        spec: AttentionLayerSpec,
        backends: AttentionBackends,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.arch, self.index = arch, index
        heads = head_split(arch.num_heads, arch.num_kv_heads)  # this rank's (all of them in one process)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        h, kv, hd = heads.num_heads, heads.num_kv_heads, arch.head_dim
        self.qkv_proj = Linear(arch.hidden_size, (h + 2 * kv) * hd, dtype)  # q ‖ k ‖ v
        self.o_proj = Linear(h * hd, arch.hidden_size, dtype)  # row-parallel: the layer all-reduces
        # Per-head logits that join the softmax denominator only (gpt-oss style sinks).
        self.sinks = nn.Parameter(torch.empty(h, dtype=dtype), False) if arch.sinks else None
        self.register_buffer("sinks_float32", None, persistent=False)  # see float32_sinks
        self._sinks_copied: tuple[int, int] | None = None  # (address, version) of the sinks copied
        self.attn = RoleImpls(backends, spec)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding | None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, H, hd], k and v [T, H_kv, hd] (q and k roped): views of one projection
        (q and k rotated in one call)."""
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(x.shape[0], h + 2 * kv, self.arch.head_dim)
        qk, v = qkv[:, : h + kv], qkv[:, h + kv :]
        if rope is not None:  # None: a NoPE layer
            qk = rope(qk, positions)
        return qk[:, :h], qk[:, h:], v

    def attend(self, step: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention backend's part: writes every row's KV, returns [T, H, hd]."""
        sinks = {} if self.sinks is None else {"sinks": self.float32_sinks()}
        return self.attn.run(step, self.index, q, k, v, **sinks)

    def float32_sinks(self) -> torch.Tensor:
        """The sinks in float32, as the backends take them. A 16-bit model keeps a float32 copy,
        made again (in place: a CUDA graph reads it by address) only once the parameter was
        written, instead of a cast kernel per layer and step."""
        assert self.sinks is not None
        if self.sinks.dtype == torch.float32:
            return self.sinks
        written = (self.sinks.data_ptr(), self.sinks._version)
        if self.sinks_float32 is None or self.sinks_float32.device != self.sinks.device:
            self.sinks_float32 = self.sinks.float()
        elif written != self._sinks_copied:
            self.sinks_float32.copy_(self.sinks)
        self._sinks_copied = written
        return self.sinks_float32

    def output(self, out: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj of the attention output's `output_rows` (all rows when None): this rank's part
        under tensor parallelism."""
        out = select_rows(out, output_rows)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.arch.head_dim))


class GraniteMoE(nn.Module):
    """Top-k routing with the softmax taken over the k chosen logits only."""

    def __init__(self, arch: GraniteArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size, dtype=dtype), False)
        tp = parallel_state()  # each rank holds a run of whole experts
        local = local_size(arch.num_experts)
        self.experts = Experts(local, arch.hidden_size, arch.intermediate_size, dtype,
                               first=tp.tp_rank * local if tp.tp_size > 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight).float()
        top_logits, ids = logits.topk(self.top_k, dim=-1)
        return self.experts(x, top_logits.softmax(dim=-1).to(x.dtype), ids)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: GraniteArch,
        index: int,
        spec: AttentionLayerSpec,
        backends: AttentionBackends,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.residual_multiplier = arch.residual_multiplier
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = GQAAttention(arch, index, spec, backends, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if arch.num_experts:
            self.block_sparse_moe = GraniteMoE(arch, dtype)
            self.shared_mlp = (
                GatedMLP(arch.hidden_size, local_size(arch.shared_intermediate_size), dtype)
                if arch.shared_intermediate_size
                else None
            )
        else:
            self.mlp = GatedMLP(arch.hidden_size, local_size(arch.intermediate_size), dtype)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the MLP's output (the whole of it in one process)."""
        if not hasattr(self, "block_sparse_moe"):
            return self.mlp(x)
        out = self.block_sparse_moe(x)
        return out if self.shared_mlp is None else out + self.shared_mlp(x)

    def after_attention(self, x: torch.Tensor, attn_out: torch.Tensor, output_rows: torch.Tensor | None,
                        next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output for `output_rows` of x (all rows when None), from its attention
        output; next_norm of it). Each residual add shares a kernel with the norm that reads it."""
        m = self.residual_multiplier
        attn = all_reduce(self.self_attn.output(attn_out, output_rows))
        x, normed = self.post_attention_layernorm.add_and_norm(select_rows(x, output_rows), attn, m)
        return next_norm.add_and_norm(x, all_reduce(self._mlp(normed)), m)


class GraniteForCausalLM(DecoderStack):
    """Serves every architecture `granite_arch` accepts; `from_pretrained` loads a local checkpoint."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backends: AttentionBackends,
        dtype: torch.dtype,
        kv_cache_dtype: KVCacheDType = "auto",
    ) -> None:
        super().__init__()
        arch = granite_arch(hf_config)
        self.arch, self.dtype = arch, dtype
        heads = head_split(arch.num_heads, arch.num_kv_heads)
        self.layer_specs = [
            AttentionLayerSpec(
                num_heads=heads.num_attend_heads,
                head_size=arch.head_dim,
                scale=arch.attention_scale,
                num_kv_heads=heads.num_kv_heads,
                kv_cache_dtype=kv_cache_dtype,
                sliding_window=window,
            )
            for window in arch.windows
        ]
        thetas = sorted({t for t in arch.rope_thetas if t})
        self.ropes = nn.ModuleList()  # one table per distinct RoPE base
        for theta in thetas:
            inv_freq, scaling = rope_inv_freq(_with_rope_theta(hf_config, theta), arch.head_dim)
            self.ropes.append(
                RotaryEmbedding(inv_freq, scaling, arch.max_position_embeddings, interleaved=False)
            )
        self.rope_of_layer = [thetas.index(t) if t else None for t in arch.rope_thetas]  # None: NoPE
        tp = parallel_state()
        start, stop = part(arch.vocab_size, tp.tp_rank, tp.tp_size)  # this rank's vocabulary rows
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(
            torch.empty(stop - start, arch.hidden_size, dtype=dtype), False
        )
        self.model.layers = nn.ModuleList(
            DecoderLayer(arch, i, spec, backends, dtype) for i, spec in enumerate(self.layer_specs)
        )
        self.model.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        tied = self.model.embed_tokens.weight if arch.tie_word_embeddings else None
        self.lm_head = Linear(arch.hidden_size, stop - start, dtype, weight=tied,  # loaded once when tied
                              packed_min_rows=HEAD_PACKED_MIN_ROWS)
        # (a layer's output, the norm that reads it next, that norm of it): see after_attention
        self._handed: tuple[torch.Tensor, RMSNorm, torch.Tensor] | None = None

    @property
    def kv_cache_layers(self) -> list[AttentionLayerSpec]:
        """One attention layer spec per KV cache the model writes (the engine allocates them)."""
        return list(self.layer_specs)

    @functools.cached_property
    def capabilities(self) -> ModelCapabilities:
        a = self.arch
        # Recordable unless MoE experts fall back to the per-expert loop (it reads group sizes on
        # the host); the attention backend's own graph support is checked by the runner.
        device = self.model.embed_tokens.weight.device
        graph_safe = not a.num_experts or grouped_mm_supported(device, self.dtype)
        return ModelCapabilities(vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                                 num_layers=len(self.layer_specs), max_model_len=a.max_position_embeddings,
                                 dtype=self.dtype, cuda_graph_safe=graph_safe, tensor_parallel=True)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        hf_config: PretrainedConfig,
        backends: AttentionBackends,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: KVCacheDType = "auto",
    ) -> GraniteForCausalLM:
        with torch.device(device):
            model = cls(hf_config, backends, dtype, kv_cache_dtype)
        params, mapper = dict(model.named_parameters()), granite_weight_mapper(model.arch)
        if parallel_state().tp_size == 1:
            load_weights(params, iter_checkpoint(model_dir), mapper)
        else:
            load_weights(params, iter_checkpoint_slices(model_dir), mapper, granite_shard_plan(model.arch))
        return model.eval()

    @property
    def attention_output_shape(self) -> tuple[int, int]:
        return head_split(self.arch.num_heads, self.arch.num_kv_heads).num_heads, self.arch.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = embed(input_ids, self.model.embed_tokens.weight, self.arch.vocab_size)
        return scaled(rows, self.arch.embedding_multiplier)

    def before_attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layer, rope = self.model.layers[i], self.rope_of_layer[i]
        return layer.self_attn.project(self._normed(x, layer.input_layernorm), positions,
                                       None if rope is None else self.ropes[rope])

    def after_attention(self, i: int, x: torch.Tensor, attn_out: torch.Tensor,
                        output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's output. The norm that reads it next (layer i + 1's input norm, the final norm
        after the last layer) is taken in the kernel of the residual add (on CUDA) and handed to
        that reader: `before_attention` / `final_norm` take it when given this very tensor."""
        layers = self.model.layers
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
        x, normed = layers[i].after_attention(x, attn_out, output_rows, next_norm)
        self._handed = (x, next_norm, normed)
        return x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self._normed(x, self.model.norm)

    def _normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """norm(x): the one `after_attention` handed over when x is the tensor it returned (the
        handed tensors stay referenced, so no other tensor can take x's identity), else computed."""
        handed = self._handed
        if handed is not None and handed[0] is x and handed[1] is norm:
            return handed[2]
        return norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.lm_head(hidden).float(), self.arch.vocab_size)
        return logits if self.arch.logits_scaling == 1 else logits / self.arch.logits_scaling


def _with_rope_theta(hf_config: PretrainedConfig, theta: float) -> PretrainedConfig:
    """A copy of the config whose RoPE base is `theta` (for per-layer bases)."""
    if float(theta) == float(hf_config.rope_parameters["rope_theta"]):
        return hf_config
    config = copy.deepcopy(hf_config)
    config.rope_parameters = {**hf_config.rope_parameters, "rope_theta": theta}
    return config
