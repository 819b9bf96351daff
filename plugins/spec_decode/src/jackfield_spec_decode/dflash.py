"""DFlash (z-lab, "Block Diffusion for Flash Speculative Decoding"; SGLang's `DFLASH` method): a
small stack of decoder layers that drafts a whole block of tokens in one non-causal forward,
conditioned on hidden states tapped from the target, loaded from a draft checkpoint directory in
the published layout (config.json + safetensors).

What this relies on, read from the authors' reference (github.com/z-lab/dflash, dflash/model.py,
`DFlashDraftModel`) and its published configs:
- config.json: `architectures` ["DFlashDraftModel"], Qwen3-style fields (`hidden_size`,
  `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
  `intermediate_size`, `rms_norm_eps`, RoPE), and `dflash_config` {`mask_token_id`,
  `target_layer_ids`, `block_size`} (each also read at the top level, `dflash_config` first);
  `num_target_layers` the target's layer count.
- tensors (no `model.` prefix): `fc` [H, n·H] over the concatenated taps, `hidden_norm`,
  `layers.{i}.` {`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm` (per
  head), `post_attention_layernorm`, `mlp.{gate,up,down}_proj`}, `norm`; the embedding and the
  LM head are the target's.
- `target_layer_ids` i index the target's hidden states as transformers returns them with
  offset 1: the OUTPUT of layer i, which is the input of layer i + 1 (what `LayerTaps` gives;
  -1, which DeepSpec allows, is the embedding's output, layer 0's input). The last layer's
  output is not offered (transformers returns it after the final norm).

The equations, for a request whose newest token t sits at position N - 1 (no KV yet):

    c_p   = hidden_norm(fc(cat(taps at p)))                    every verified position p <= N - 2
    layer l's context K/V at p = rope(k_norm(k_proj_l(c_p))), v_proj_l(c_p)   (no input norm)
    x     = embed([t, MASK x d]) at positions N - 1 .. N - 1 + d
    per layer: a = input_layernorm(x); q, k, v of a (q_norm / k_norm, then RoPE);
               x = x + o_proj(attention of q over the context K/V and the block's own K/V,
                                 NON-causal: every block row sees every block row)
               x = x + mlp(post_attention_layernorm(x))
    logits of block row j + 1 = the target's head over norm(x): draft j at position N + j

The block is k + 1 rows (fewer where a request may draft fewer), not the trained `block_size`:
the reference runs shorter blocks the same way at the end of a generation, and the MASK rows'
mutual attention then spans fewer rows, so a draft trained on blocks of 16 drafts best with
k = 15; `block_size` bounds k.

The context K/V go into the drafter's own KV cache layers (one per draft layer), written for
every verified position every step (`DraftContext.verified`), so the block attends them as a
prefix; the block's K/V land in the newest token's slot and the reserved lookahead
(`lookahead_tokens` = k + 1) and are overwritten by later steps. The block's attention is the
target's decode backend with non-causal metadata: `load` refuses a backend whose
`supports_non_causal(device, kv_cache_dtype, k + 1)` is false, naming it. Drafts are sampled at
the request's temperature from the drafting noise stream (argmax where greedy), over the target's
whole vocabulary (the head is the target's: no draft-to-target map), their probabilities kept so
the rejection rule's q is exact. The embedding is `ModelFamily.embed` and the head
`compute_logits`, the target's own (Granite's multipliers included; published drafts are for
Qwen3, Llama and gpt-oss targets, which have none). The block layout, the Markov head and the
config's architecture are a `DraftKind`'s: DFLASH here, DSPARK in dspark.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.drafter import DraftContext, DrafterOptions, DraftProposal, ModelDrafter
from jackfield.contracts.model import ModelFamily
from jackfield.models.attention import RoleImpls
from jackfield.models.hf_config import hf_config_from_dict, rope_inv_freq
from jackfield.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from jackfield.models.weights import Rule, WeightMapper, checkpoint_files, iter_checkpoint, load_weights
from torch import nn

from jackfield_spec_decode.eagle3 import TargetShape, int_field, target_shape

_PREFIX = r"(?:model\.)?"
DRAFT_RULES = (
    Rule(_PREFIX + r"layers\.(?P<i>\d+)\.mlp\.gate_proj\.weight", "layers.{i}.mlp.gate_up_proj.weight",
         shard=(0, 2)),
    Rule(_PREFIX + r"layers\.(?P<i>\d+)\.mlp\.up_proj\.weight", "layers.{i}.mlp.gate_up_proj.weight",
         shard=(1, 2)),
    Rule(_PREFIX + r"(?P<name>.+)", "{name}"),
)


@dataclass(frozen=True)
class DraftKind:
    """What tells DFlash and DSpark drafts apart (dspark.py describes DSpark)."""

    method: str  # the [speculative] method
    architectures: tuple[str, ...]  # config.json's architectures, as the authors' classes name them
    # block rows past the drafts: DFlash's newest-token row drafts nothing (1), DSpark's drafts
    # the token after it (0)
    extra_block_rows: int
    markov: bool  # a Markov head adds a previous-token bias to each draft's logits
    weights: WeightMapper


DFLASH = DraftKind("dflash", ("DFlashDraftModel",), 1, False,
                   WeightMapper(rules=DRAFT_RULES, ignore=(r".*rotary_emb\.inv_freq",)))


@dataclass(frozen=True)
class DFlashConfig:
    """A draft checkpoint's config.json, as the drafter reads it."""

    path: Path  # the config.json
    data: dict[str, object]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    block_size: int  # the block the draft was trained on: [newest token, MASK x (block_size - 1)]
    mask_token_id: int
    # the target layers whose outputs fc reads, in its column order (-1: the embedding's)
    target_layer_ids: tuple[int, ...]
    markov_rank: int  # 0: no Markov head


def read_dflash_config(model: str | None, target: TargetShape, num_speculative_tokens: int,
                       kind: DraftKind = DFLASH) -> DFlashConfig:
    """The draft checkpoint's config, checked against the target and k; a ValueError names the
    file and field of the first problem (`speculative.model` when there is no directory)."""
    if model is None:
        raise ValueError(f"speculative.model: {kind.method} drafts with a draft checkpoint directory; "
                         "none is set")
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
        return _dflash_config(path, data, target, num_speculative_tokens, kind)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _draft_field(data: dict[str, object], name: str) -> tuple[str, object]:
    """(the field's name as found, its value): `dflash_config.<name>` first, then `<name>`."""
    nested = data.get("dflash_config")
    if isinstance(nested, dict) and name in nested:
        return f"dflash_config.{name}", nested[name]
    return name, data.get(name)


def _dflash_config(path: Path, data: dict[str, object], target: TargetShape, num_speculative_tokens: int,
                   kind: DraftKind) -> DFlashConfig:
    archs = data.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in kind.architectures:
        raise ValueError(f"architectures {archs!r} is not a {kind.method} draft model "
                         f"({' or '.join(kind.architectures)})")
    hidden = int_field(data, "hidden_size")
    if hidden != target.hidden_size:
        raise ValueError(f"hidden_size {hidden} differs from the target model's {target.hidden_size}")
    vocab = int_field(data, "vocab_size")
    if vocab != target.vocab_size:  # the draft runs the target's embedding and head
        raise ValueError(f"vocab_size {vocab} differs from the target model's {target.vocab_size}")
    heads = int_field(data, "num_attention_heads")
    kv_heads = int_field(data, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = int_field({"head_dim": data.get("head_dim") or hidden // heads}, "head_dim")
    eps = data.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, float | int) or eps <= 0:
        raise ValueError(f"rms_norm_eps must be a number > 0, got {eps!r}")
    if data.get("attention_bias"):
        raise ValueError("attention_bias is true; DFlash drafts have bias-free projections")
    if data.get("is_causal") is True:
        raise ValueError("is_causal is true; a DFlash draft attends its block non-causally")
    types = data.get("layer_types")
    sliding = isinstance(types, list) and any(t != "full_attention" for t in types)
    if data.get("use_sliding_window") or sliding:
        raise ValueError(f"sliding-window layers (use_sliding_window {data.get('use_sliding_window')!r}, "
                         f"layer_types {types!r}) are not run: every layer must be full_attention")
    layers = int_field(data, "num_hidden_layers")
    count = data.get("num_target_layers")
    if count is not None and count != target.num_layers:
        raise ValueError(f"num_target_layers {count!r} differs from the target model's {target.num_layers}")
    field, ids = _draft_field(data, "target_layer_ids")
    if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
            or not all(isinstance(i, int) and not isinstance(i, bool) and -1 <= i < target.num_layers - 1
                       for i in ids)):
        raise ValueError(f"{field} {ids!r} must name distinct layers of the target's {target.num_layers} "
                         f"whose outputs feed a further layer (0 .. {target.num_layers - 2}; -1: the "
                         "embedding)")
    field, mask = _draft_field(data, "mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise ValueError(f"{field} {mask!r} must be a token id of the target's vocabulary "
                         f"(0 .. {target.vocab_size - 1})")
    field, block = _draft_field(data, "block_size")
    block = int_field({field: 16 if block is None else block}, field)  # the reference's default
    if num_speculative_tokens + kind.extra_block_rows > block:
        raise ValueError(f"{field} {block} is too small for num_speculative_tokens {num_speculative_tokens}: "
                         f"the block holds the newest token and the drafts")
    markov_rank = 0
    if kind.markov:
        markov_rank = int_field(data, "markov_rank")
        head = data.get("markov_head_type", "vanilla")
        if head != "vanilla":
            raise ValueError(f"markov_head_type {head!r} is not run: only the vanilla Markov head (an "
                             "Embedding(V, r) and an r -> V projection) is")
    return DFlashConfig(
        path=path, data=data, hidden_size=hidden, intermediate_size=int_field(data, "intermediate_size"),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(eps),
        max_position_embeddings=int_field(data, "max_position_embeddings", 2048), block_size=block,
        mask_token_id=mask, target_layer_ids=tuple(ids), markov_rank=markov_rank,
    )


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig, spec: AttentionLayerSpec, backends: AttentionBackends,
                 cache: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.cache = c, cache
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, dtype)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, dtype)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, dtype)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.attn = RoleImpls(backends, spec)

    def key_value(self, x: torch.Tensor, positions: torch.Tensor,
                  rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        c, t = self.c, x.shape[0]
        k = rope(self.k_norm(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)), positions)
        return k, self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)

    def write_context(self, step: StepContext, context: torch.Tensor, positions: torch.Tensor,
                      rope: RotaryEmbedding) -> None:
        """The context K/V of verified rows into the layer's cache (no queries)."""
        k, v = self.key_value(context, positions, rope)
        cache = step.kv_caches[self.cache]
        scale = step.kv_scale(self.cache)
        for rows, impl, metadata in self.attn.parts(step, self.cache):
            impl.write_kv(cache, metadata.slot_mapping, k[rows], v[rows], scale)

    def forward(self, step: StepContext, x: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding) -> torch.Tensor:
        c, t = self.c, x.shape[0]
        q = rope(self.q_norm(self.q_proj(x).view(t, c.num_heads, c.head_dim)), positions)
        k, v = self.key_value(x, positions, rope)
        out = self.attn.run(step, self.cache, q, k, v)
        return self.o_proj(out.reshape(t, c.num_heads * c.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig, spec: AttentionLayerSpec, backends: AttentionBackends,
                 cache: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = DFlashAttention(c, spec, backends, cache, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, dtype)

    def forward(self, step: StepContext, x: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(step, self.input_layernorm(x), positions, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's previous-token bias over the vocabulary: markov_w2(markov_w1[previous token])."""

    def __init__(self, vocab_size: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.markov_w1 = Linear(rank, vocab_size, dtype)  # the Embedding(V, r) table [V, r]
        self.markov_w2 = Linear(rank, vocab_size, dtype)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(F.embedding(previous, self.markov_w1.weight))


class DFlashModel(nn.Module):
    """The draft's parameters, named as the published checkpoints name them (gate ‖ up fused)."""

    def __init__(self, c: DFlashConfig, backends: AttentionBackends, kv_cache_dtype: KVCacheDType,
                 first_cache: int, max_positions: int, vocab_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = AttentionLayerSpec(num_heads=c.num_heads, head_size=c.head_dim, scale=c.head_dim**-0.5,
                                       num_kv_heads=c.num_kv_heads, kv_cache_dtype=kv_cache_dtype)
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, dtype)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(DFlashLayer(c, self.spec, backends, first_cache + i, dtype)
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.markov_head = MarkovHead(vocab_size, c.markov_rank, dtype) if c.markov_rank else None
        inv_freq, scaling = rope_inv_freq(hf_config_from_dict({**c.data, "model_type": "qwen3"}), c.head_dim)
        self.rope = RotaryEmbedding(inv_freq, scaling, max_positions, interleaved=False)


class DFlashDrafter(ModelDrafter):
    name = "dflash"
    kind: ClassVar[DraftKind] = DFLASH

    def __init__(self, options: DrafterOptions) -> None:
        super().__init__(options)
        self.model: DFlashModel | None = None
        self.mask_token_id = 0
        self._tap_layers: tuple[int, ...] = ()

    @property
    def lookahead_tokens(self) -> int:
        return self.num_speculative_tokens + self.kind.extra_block_rows  # the block's slots past N - 1

    @property
    def extra_block_rows(self) -> int:
        return self.kind.extra_block_rows

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self._tap_layers

    def load(self, target: ModelFamily, backends: AttentionBackends, kv_cache_dtype: KVCacheDType,
             first_cache: int) -> list[AttentionLayerSpec]:
        caps = target.capabilities
        k = self.num_speculative_tokens
        shape = TargetShape(caps.vocab_size, caps.hidden_size, caps.num_layers)
        c = read_dflash_config(self.options.model, shape, k, self.kind)
        device = next(target.parameters()).device
        backend = backends.decode  # the block's rows run as decode rows
        if not (backend.capabilities.non_causal
                and backend.supports_non_causal(device, kv_cache_dtype, k + self.kind.extra_block_rows)):
            rows = k + self.kind.extra_block_rows
            raise ValueError(f"{c.path}: a {self.kind.method} draft attends its block of {rows} rows "
                             f"non-causally; the "
                             f"attention backend {backend.name!r} does not on {device} with kv_cache_dtype "
                             f"{kv_cache_dtype!r}: choose one that does (torch_ref does)")
        model_dir = c.path.parent
        checkpoint_files(model_dir)  # a FileNotFoundError names the directory
        max_positions = max(c.max_position_embeddings, caps.max_model_len)
        try:
            with torch.device(device):
                model = DFlashModel(c, backends, kv_cache_dtype, first_cache, max_positions, caps.vocab_size,
                                    caps.dtype)
        except ValueError as exc:  # e.g. an MLA-only backend asked for the draft's GQA layers
            raise ValueError(f"{c.path}: the draft's attention layers ({c.num_heads} query heads, "
                             f"{c.num_kv_heads} KV heads of {c.head_dim}) on the target's attention "
                             f"backends: {exc}") from None
        try:
            load_weights(dict(model.named_parameters()), iter_checkpoint(model_dir), self.kind.weights)
        except ValueError as exc:
            raise ValueError(f"{model_dir}: {exc}") from None
        self.model, self.mask_token_id = model.eval(), c.mask_token_id
        self._tap_layers = tuple(i + 1 for i in c.target_layer_ids)  # layer i's output is layer i + 1's input
        return [model.spec] * c.num_layers

    def propose(self, context: DraftContext) -> DraftProposal:
        model, verified = self.model, context.verified
        assert model is not None, "load() runs first"
        contexts = model.hidden_norm(model.fc(torch.cat(context.taps, dim=-1)))
        for layer in model.layers:
            layer.self_attn.write_context(verified.step, contexts, verified.positions, model.rope)
        requests = list(range(context.num_drafting))
        if not requests:
            return DraftProposal([], [])
        extra = self.kind.extra_block_rows
        sizes = [d + extra for d in context.max_drafts]
        step, positions = context.block_attention(requests, sizes)
        device = positions.device
        starts = torch.tensor([0, *sizes], device=device).cumsum(0)[:-1]
        newest = verified.input_ids[context.last_rows]  # the token at N - 1, after the newest verified row
        input_ids = torch.full((sum(sizes),), self.mask_token_id, dtype=torch.int64, device=device)
        input_ids[starts] = newest
        x = context.model.embed(input_ids)
        for layer in model.layers:
            x = layer(step, x, positions, model.rope)
        out = model.norm(x)
        drafts: list[list[int]] = [[] for _ in requests]
        chosen: list[list[torch.Tensor]] = [[] for _ in requests]
        previous = newest  # per request: the token before its next draft (the Markov head's input)
        live = list(requests)  # requests still drafting (none of their drafts lacked a finite logit)
        for draft in range(max(context.max_drafts)):  # left to right: each draft sees the one before
            rows = [r for r in live if context.max_drafts[r] > draft]
            if not rows:
                break
            at = torch.tensor(rows, device=device)
            logits = context.model.compute_logits(out[starts[at] + extra + draft]).float()
            if model.markov_head is not None:
                logits = logits + model.markov_head(previous[at]).float()
            tokens, probs = context.sample(logits, rows, draft)
            previous = previous.index_copy(0, at, tokens.clamp(min=0))
            for i, (r, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                if token < 0:  # no finite logit: this request's later drafts are dropped too
                    live.remove(r)
                    continue
                drafts[r].append(token)
                if probs is not None:
                    chosen[r].append(probs[i])
        # A greedy request's rows may lack probabilities (a step of greedy rows only has none): it needs none.
        probabilities = [torch.stack(rows) if rows and len(rows) == len(d) else None
                         for rows, d in zip(chosen, drafts, strict=True)]
        return DraftProposal(drafts, probabilities)


def check_dflash_model(model: str | None, target_config: Mapping[str, object],
                       kind: DraftKind = DFLASH) -> list[str]:
    """`DrafterSpec.check_model`: the draft checkpoint's problems against the target's config.json
    (what shows without reading tensors; a block too small for k shows at start-up, where k is
    known)."""
    try:
        shape = target_shape(dict(target_config))
    except ValueError as exc:
        return [f"the target's config.json: {exc}"]
    try:
        read_dflash_config(model, shape, 1, kind)
        checkpoint_files(model)  # type: ignore[arg-type]  # read_dflash_config refused None
    except (ValueError, FileNotFoundError) as exc:
        return [str(exc)]
    return []
