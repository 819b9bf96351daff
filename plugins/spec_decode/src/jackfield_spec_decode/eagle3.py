"""EAGLE-3 (Li et al., 2025; vLLM's and SGLang's `eagle3` method): a one-layer draft head over
hidden states tapped from three of the target's layers, loaded from a draft checkpoint directory
in the published layout (config.json + safetensors).

The head, for a row at position p pairing the token t at p + 1 with a hidden state h of p:

    h_0   = fc(cat(x_a, x_b, x_c))              the target's inputs of the tapped layers at p (3H -> H)
    z     = cat(input_layernorm(embed(t)), hidden_norm(h))            width 2H (embedding first)
    r     = o_proj(attention(q, k, v of z, RoPE at p)) + h            (+ hidden_norm(h) instead of h
    out   = r + mlp(post_attention_layernorm(r))                         when norm_before_residual)
    logits over the draft vocabulary = lm_head(norm(out)); draft id i is target id i + d2t[i]

Each step (jackfield.contracts.drafter.DraftContext) the layer runs over the step's verified rows
with h = h_0, so its own KV cache holds every verified position; its output at a request's newest
row drafts the first token. Draft j >= 1 feeds the previous draft's `out` (before `norm`) back as h,
one row per request. Drafts are sampled at the request's temperature from the drafting noise
stream (argmax where greedy) from logits scattered into the target's vocabulary (-inf outside the
draft's), so the rejection rule's q is exact and zero for ids the head cannot draft. The embedding
is the target's unless the checkpoint stores its own `embed_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.drafter import ChainDrafter, DraftContext, DrafterOptions, DraftProposal, DraftRows
from jackfield.contracts.model import ModelFamily, eagle3_tap_layers
from jackfield.models.attention import RoleImpls
from jackfield.models.hf_config import hf_config_from_dict, rope_inv_freq
from jackfield.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from jackfield.models.weights import Rule, WeightMapper, checkpoint_files, iter_checkpoint, load_weights
from safetensors import safe_open
from torch import nn

from jackfield_spec_decode.chain import draft_chain
from jackfield_spec_decode.vocab import draft_to_target_ids

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # as vLLM registers them

_PREFIX = r"(?:model\.)?"
_LAYER = _PREFIX + r"(?:midlayer|layers\.0)\."  # the published name, and SpecForge's
EAGLE3_WEIGHTS = WeightMapper(
    rules=(
        Rule(_LAYER + r"mlp\.gate_proj\.weight", "layer.mlp.gate_up_proj.weight", shard=(0, 2)),
        Rule(_LAYER + r"mlp\.up_proj\.weight", "layer.mlp.gate_up_proj.weight", shard=(1, 2)),
        Rule(_LAYER + r"(?P<name>.+)", "layer.{name}"),
        Rule(_PREFIX + r"(?P<name>fc\.weight|norm\.weight|embed_tokens\.weight)", "{name}"),
        Rule(r"lm_head\.weight", "lm_head.weight"),
    ),
    ignore=(r"d2t", r"t2d", r".*rotary_emb\.inv_freq"),
)


@dataclass(frozen=True)
class TargetShape:
    """What the head must agree with, from the target's config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int


@dataclass(frozen=True)
class Eagle3Config:
    """A draft checkpoint's config.json, as the head reads it."""

    path: Path  # the config.json
    data: dict[str, object]
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    max_position_embeddings: int
    norm_before_residual: bool
    tap_layers: tuple[int, ...]  # the target layers whose inputs fc reads, in its column order


def int_field(data: dict[str, object], name: str, default: int | None = None) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def read_eagle3_config(model: str | None, target: TargetShape) -> Eagle3Config:
    """The draft checkpoint's config, checked against the target; a ValueError names the file and
    field of the first problem (`speculative.model` when there is no directory)."""
    if model is None:
        raise ValueError("speculative.model: eagle3 drafts with a draft checkpoint directory; none is set")
    path = Path(model) / "config.json"
    if not Path(model).is_dir():
        raise ValueError(f"speculative.model {model}: no such directory")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    try:
        return _eagle3_config(path, data, target)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _eagle3_config(path: Path, data: dict[str, object], target: TargetShape) -> Eagle3Config:
    archs = data.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"architectures {archs!r} is not an EAGLE-3 draft head "
                         f"({' or '.join(ARCHITECTURES)})")
    if int_field(data, "num_hidden_layers") != 1:
        raise ValueError(f"num_hidden_layers is {data['num_hidden_layers']}; EAGLE-3 heads have one layer")
    hidden = int_field(data, "hidden_size")
    if hidden != target.hidden_size:
        raise ValueError(f"hidden_size {hidden} differs from the target model's {target.hidden_size}")
    target_hidden = int_field(data, "target_hidden_size", hidden)
    if target_hidden != target.hidden_size:
        raise ValueError(f"target_hidden_size {target_hidden} differs from the target model's hidden_size "
                         f"{target.hidden_size}")
    vocab = int_field(data, "vocab_size")
    if vocab != target.vocab_size:
        raise ValueError(f"vocab_size {vocab} differs from the target model's {target.vocab_size}")
    draft_vocab = int_field(data, "draft_vocab_size", vocab)
    if draft_vocab > vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
    heads = int_field(data, "num_attention_heads")
    kv_heads = int_field(data, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = data.get("head_dim") or hidden // heads
    eps = data.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, float | int) or eps <= 0:
        raise ValueError(f"rms_norm_eps must be a number > 0, got {eps!r}")
    eagle_config = data.get("eagle_config")
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    field = "eagle_config.eagle_aux_hidden_state_layer_ids" if nested is not None else \
        "eagle_aux_hidden_state_layer_ids"
    taps = nested if nested is not None else data.get("eagle_aux_hidden_state_layer_ids")
    if taps is None:
        taps = eagle3_tap_layers(target.num_layers)
        if len(taps) != 3:
            raise ValueError(f"the target's {target.num_layers} layers give no three distinct default tap "
                             f"layers (2, L // 2, L - 3): set eagle_aux_hidden_state_layer_ids")
    elif (not isinstance(taps, list) or len(taps) != 3 or len(set(taps)) != 3
          or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < target.num_layers
                     for i in taps)):
        raise ValueError(f"{field} {taps!r} must name three distinct layers of the target's "
                         f"{target.num_layers} (0 .. {target.num_layers - 1})")
    return Eagle3Config(
        path=path, data=data, hidden_size=hidden, intermediate_size=int_field(data, "intermediate_size"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=int_field({"head_dim": head_dim}, "head_dim"),
        rms_norm_eps=float(eps), vocab_size=vocab, draft_vocab_size=draft_vocab,
        max_position_embeddings=int_field(data, "max_position_embeddings", 2048),
        norm_before_residual=bool(data.get("norm_before_residual", False)), tap_layers=tuple(taps),
    )


def target_shape(config_json: dict[str, object]) -> TargetShape:
    """The target's sizes from its config.json (a ValueError names a missing field)."""
    return TargetShape(int_field(config_json, "vocab_size"), int_field(config_json, "hidden_size"),
                       int_field(config_json, "num_hidden_layers"))


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config, spec: AttentionLayerSpec, backends: AttentionBackends,
                 cache: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.cache = c, cache
        self.q_proj = Linear(2 * c.hidden_size, c.num_heads * c.head_dim, dtype)
        self.k_proj = Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, dtype)
        self.v_proj = Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, dtype)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, dtype)
        self.attn = RoleImpls(backends, spec)

    def forward(self, step: StepContext, z: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding) -> torch.Tensor:
        c, t = self.c, z.shape[0]
        q = rope(self.q_proj(z).view(t, c.num_heads, c.head_dim), positions)
        k = rope(self.k_proj(z).view(t, c.num_kv_heads, c.head_dim), positions)
        v = self.v_proj(z).view(t, c.num_kv_heads, c.head_dim)
        out = self.attn.run(step, self.cache, q, k, v)
        return self.o_proj(out.reshape(t, c.num_heads * c.head_dim))


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config, spec: AttentionLayerSpec, backends: AttentionBackends,
                 cache: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Eagle3Attention(c, spec, backends, cache, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, dtype)

    def forward(self, step: StepContext, embedded: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        z = torch.cat((self.input_layernorm(embedded), normed), dim=-1)
        residual = normed if self.norm_before_residual else hidden
        r = self.self_attn(step, z, positions, rope) + residual
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(nn.Module):
    """The head's parameters, named as the published checkpoints name them (`layer` for the
    checkpoint's `midlayer` / `layers.0`, gate ‖ up fused)."""

    def __init__(self, c: Eagle3Config, backends: AttentionBackends, kv_cache_dtype: KVCacheDType,
                 cache: int, max_positions: int, own_embedding: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = AttentionLayerSpec(num_heads=c.num_heads, head_size=c.head_dim, scale=c.head_dim**-0.5,
                                       num_kv_heads=c.num_kv_heads, kv_cache_dtype=kv_cache_dtype)
        self.fc = Linear(3 * c.hidden_size, c.hidden_size, dtype)
        self.layer = Eagle3Layer(c, self.spec, backends, cache, dtype)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, dtype)
        # the checkpoint's own embedding table [vocab, H] (a Linear's weight has that layout)
        self.embed_tokens = Linear(c.hidden_size, c.vocab_size, dtype) if own_embedding else None
        inv_freq, scaling = rope_inv_freq(hf_config_from_dict({"model_type": "llama", **c.data}), c.head_dim)
        self.rope = RotaryEmbedding(inv_freq, scaling, max_positions, interleaved=False)


class Eagle3Drafter(ChainDrafter):
    name = "eagle3"

    def __init__(self, options: DrafterOptions) -> None:
        super().__init__(options)
        self.head: Eagle3Head | None = None
        self.draft_to_target: torch.Tensor | None = None  # None: the draft vocabulary is the target's
        self.vocab_size = 0  # the target's
        self._tap_layers: tuple[int, ...] = ()

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self._tap_layers

    def load(self, target: ModelFamily, backends: AttentionBackends, kv_cache_dtype: KVCacheDType,
             first_cache: int) -> list[AttentionLayerSpec]:
        caps = target.capabilities
        c = read_eagle3_config(self.options.model, TargetShape(caps.vocab_size, caps.hidden_size,
                                                               caps.num_layers))
        model_dir = c.path.parent
        files = checkpoint_files(model_dir)
        names = {name: file for file in files for name in _names(file)}
        device = next(target.parameters()).device
        own_embedding = "embed_tokens.weight" in names or "model.embed_tokens.weight" in names
        max_positions = max(c.max_position_embeddings, caps.max_model_len)
        try:
            with torch.device(device):
                head = Eagle3Head(c, backends, kv_cache_dtype, first_cache, max_positions, own_embedding,
                                  caps.dtype)
        except ValueError as exc:  # e.g. an MLA-only backend asked for the head's GQA layer
            raise ValueError(f"{c.path}: the head's attention layer ({c.num_heads} query heads, "
                             f"{c.num_kv_heads} KV heads of {c.head_dim}) on the target's attention "
                             f"backends: {exc}") from None
        try:
            load_weights(dict(head.named_parameters()), iter_checkpoint(model_dir), EAGLE3_WEIGHTS)
        except ValueError as exc:
            raise ValueError(f"{model_dir}: {exc}") from None
        d2t = None
        if "d2t" in names:
            with safe_open(str(names["d2t"]), framework="pt") as f:
                d2t = f.get_tensor("d2t").to(device)
        source = f"{names.get('d2t', model_dir / '*.safetensors')}: d2t"
        self.draft_to_target = draft_to_target_ids(c.draft_vocab_size, caps.vocab_size, d2t, source=source)
        self.head, self.vocab_size, self._tap_layers = head.eval(), caps.vocab_size, c.tap_layers
        return [head.spec]

    def draft_forward(self, model: ModelFamily, draft: int, rows: DraftRows) -> torch.Tensor:
        """The head's layer over `rows` (writing their KV): `out` of each row, before `norm`."""
        head = self.head
        assert head is not None, "load() runs first"
        if head.embed_tokens is None:
            embedded = model.embed(rows.input_ids)
        else:
            embedded = F.embedding(rows.input_ids, head.embed_tokens.weight)
        return head.layer(rows.step, embedded, rows.hidden, rows.positions, head.rope)

    def verified_forward(self, model: ModelFamily, rows: DraftRows, taps: Sequence[torch.Tensor],
                         ) -> torch.Tensor:
        """The head's layer over the verified rows, each continuing from `fc` of its taps."""
        head = self.head
        assert head is not None, "load() runs first"
        fused = head.fc(torch.cat(tuple(taps), dim=-1))
        return self.draft_forward(model, 0, DraftRows(rows.input_ids, rows.positions, fused, rows.step))

    def draft_logits(self, model: ModelFamily, draft: int, out: torch.Tensor) -> torch.Tensor:
        """float32 [R, target vocabulary] of outputs `out` (-inf for ids outside the draft's)."""
        head = self.head
        assert head is not None, "load() runs first"
        logits = head.lm_head(head.norm(out)).float()
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), -torch.inf)
        return full.index_copy_(1, self.draft_to_target, logits)

    def propose(self, context: DraftContext) -> DraftProposal:
        model = context.model
        out = self.verified_forward(model, context.verified, context.taps)
        return draft_chain(context, self.num_speculative_tokens, out[context.last_rows],
                           lambda draft, hidden: self.draft_logits(model, draft, hidden),
                           lambda draft, rows: self.draft_forward(model, draft, rows))


def _names(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def check_eagle3_model(model: str | None, target_config: Mapping[str, object]) -> list[str]:
    """`DrafterSpec.check_model`: the draft checkpoint's problems against the target's config.json
    (what shows without reading tensors)."""
    try:
        shape = target_shape(dict(target_config))
    except ValueError as exc:
        return [f"the target's config.json: {exc}"]
    try:
        read_eagle3_config(model, shape)
        checkpoint_files(model)  # type: ignore[arg-type]  # read_eagle3_config refused None
    except (ValueError, FileNotFoundError) as exc:
        return [str(exc)]
    return []
