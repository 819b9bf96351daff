"""Random draft checkpoints in the published layouts, for tests (as jackfield.testing writes
target checkpoints): EAGLE-3 heads (config.json + model.safetensors with `fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t` and `t2d`, and `embed_tokens` when asked) and DFlash drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

RMS_NORM_EPS, ROPE_THETA = 1e-5, 10000.0  # the draft checkpoints' config.json values


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm of a written draft, in x's dtype (the tests' float64 references)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS) * weight


def reference_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated as Llama and Qwen3 do (pairs i, i + d/2), in float64."""
    d = x.shape[-1]
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
    return x * cos + rotated * sin


def write_eagle3(directory: Path, target: Path, seed: int, taps: list[int] | None,
                 draft_vocab: int | None = None, own_embedding: bool = False,
                 norm_before_residual: bool = False, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                 intermediate: int = 48, head_scale: float = 1.0, attention_scale: float = 0.3,
                 **config: object) -> dict[str, torch.Tensor]:
    """A random head for the target in `target` (its config.json), in the published layout; the
    draft vocabulary (if smaller) is a random subset of the target's. `head_scale`: the lm_head's
    weight scale (1.0: logits of std ~sqrt(hidden), near one-hot drafts). `attention_scale`: the
    q and k projections' (attention scores of std ~2 hidden s^2: at 0.3 and a wide hidden size,
    hundreds, so each row attends one key, and a rounding step of its inputs may pick another
    one and move its output by far more than rounding). Returns its tensors."""
    target_config = json.loads((target / "config.json").read_text())
    hidden, vocab = target_config["hidden_size"], target_config["vocab_size"]
    draft_vocab = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1 + weight(hidden, scale=0.1)

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors = {
        "fc.weight": weight(hidden, 3 * hidden, scale=0.2),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": weight(q, 2 * hidden, scale=attention_scale),
        "midlayer.self_attn.k_proj.weight": weight(kv, 2 * hidden, scale=attention_scale),
        "midlayer.self_attn.v_proj.weight": weight(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, q),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, intermediate),
        "norm.weight": norm(),
        "lm_head.weight": weight(draft_vocab, hidden, scale=head_scale),
    }
    target_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    tensors["d2t"] = target_ids - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, target_ids, True)
    if own_embedding:
        tensors["embed_tokens.weight"] = weight(vocab, hidden, scale=1.0)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    data: dict[str, object] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": RMS_NORM_EPS, "rope_theta": ROPE_THETA,
        "max_position_embeddings": 512, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False, "norm_before_residual": norm_before_residual,
    }
    if taps is not None:
        data["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": taps}
    (directory / "config.json").write_text(json.dumps({**data, **config}))
    return tensors


def write_dflash(directory: Path, target: Path, seed: int, target_layer_ids: list[int], mask_token_id: int,
                 block_size: int = 8, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                 intermediate: int = 48, markov_rank: int = 0, **config: object) -> dict[str, torch.Tensor]:
    """A random DFlash draft for the target in `target` (its config.json), in the published
    layout (`fc`, `hidden_norm`, `layers.{i}.*` with q/k norms, `norm`; `dflash_config` holding
    `block_size`, `mask_token_id` and `target_layer_ids`), or with `markov_rank` > 0 a DSpark
    draft in DeepSpec's layout (those fields at the top level, `markov_head.markov_w{1,2}`, and
    copies of the target's embedding and head). Returns its tensors."""
    target_config = json.loads((target / "config.json").read_text())
    hidden, vocab = target_config["hidden_size"], target_config["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(size: int = hidden) -> torch.Tensor:
        return 1 + weight(size, scale=0.1)

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors = {"fc.weight": weight(hidden, len(target_layer_ids) * hidden, scale=0.2),
               "hidden_norm.weight": norm(), "norm.weight": norm()}
    for i in range(layers):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": weight(q, hidden),
            p + "self_attn.k_proj.weight": weight(kv, hidden),
            p + "self_attn.v_proj.weight": weight(kv, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, q),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": weight(intermediate, hidden),
            p + "mlp.up_proj.weight": weight(intermediate, hidden),
            p + "mlp.down_proj.weight": weight(hidden, intermediate),
        }
    draft_fields: dict[str, object] = {"block_size": block_size, "mask_token_id": mask_token_id,
                                       "target_layer_ids": target_layer_ids}
    if markov_rank:
        tensors |= {"markov_head.markov_w1.weight": weight(vocab, markov_rank, scale=1.0),
                    "markov_head.markov_w2.weight": weight(vocab, markov_rank, scale=1.0),
                    "embed_tokens.weight": weight(vocab, hidden), "lm_head.weight": weight(vocab, hidden)}
        draft_fields = {"architectures": ["Qwen3DSparkModel"], **draft_fields, "markov_rank": markov_rank,
                        "markov_head_type": "vanilla", "enable_confidence_head": False, "num_anchors": 512}
    else:
        draft_fields = {"architectures": ["DFlashDraftModel"], "dflash_config": draft_fields}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    data: dict[str, object] = {
        "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": layers, "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": 512, "vocab_size": vocab, "attention_bias": False,
        "num_target_layers": target_config["num_hidden_layers"], "tie_word_embeddings": False, **draft_fields,
    }
    (directory / "config.json").write_text(json.dumps({**data, **config}))
    return tensors


# per request of a step: the drafts it verified, the step's q, its new tokens, its drafter's drafts
OracleStep = list[tuple[int, int, list[int], list[int]]]


def oracle_drafts(runner: Any, prompts: list[list[int]], reference: list[list[int]],
                  vocab: int) -> list[OracleStep]:
    """Replaces the drafts a model runner hands the engine by an oracle's, so greedy verify steps
    meet every accepted count: from `reference` (request r's greedy tokens without drafts, its
    request id r, its prompt prompts[r]), in turn per step and request, its drafter's count of
    drafts all right, right then wrong, all wrong, wrong then right (matches after a mismatch
    count for nothing), or one right draft only (fewer rows than the batch's q - 1). Returns the
    list that gets each step's requests: what they verified and what the drafter drafted."""
    inner, seen = runner._draft, []

    def oracle(chunks, hidden, emitted, *rest):  # type: ignore[no-untyped-def]
        drafts = inner(chunks, hidden, emitted, *rest)
        sampling = [c for c in chunks if c.samples]
        q = 1 + max(c.num_drafts for c in sampling) if sampling else 0
        step: OracleStep = []
        verified = []
        for chunk, new, (ids, probs) in zip(sampling, emitted, drafts, strict=True):
            r = chunk.seq.request_id
            assert chunk.seq.token_ids[: len(prompts[r])] == prompts[r] and probs is None
            step.append((chunk.num_drafts, q, new, ids))
            done = chunk.seq.num_output_tokens + len(new)
            right = reference[r][done : done + len(ids)]
            wrong = [(t + 1) % vocab for t in right]
            turns = [right, right[:1] + wrong[1:], wrong, wrong[:1] + right[1:], right[:1]]
            verified.append((turns[(r + len(seen)) % len(turns)], None))
        seen.append(step)
        return verified

    runner._draft = oracle
    return seen


def check_oracle_steps(steps: list[OracleStep], k: int) -> None:
    """The oracle's verify steps (q > 1) met every accepted count a of d drafts: none, some, all
    k, and fewer drafts than the batch's q - 1, every one accepted; and some request's limit was
    short of k."""
    verify = [(d, q, len(new) - 1, ids) for step in steps for d, q, new, ids in step if q > 1]
    assert any(d and a == 0 for d, _, a, _ in verify), "no step rejected every draft"
    assert any(0 < a < d for d, _, a, _ in verify), "no step accepted some drafts"
    assert any(a == d == k for d, _, a, _ in verify), "no step accepted all k drafts"
    assert any(0 < d == a < q - 1 for d, q, a, _ in verify), "no step of fewer drafts, all accepted"
    assert any(0 < len(ids) < k for _, _, _, ids in verify), "no limit short of k"
