"""What the hybrid families (attention layers beside recurrent ones) share: the layer dispatch
of the model contract's pieces, the indices of each layer's KV cache or recurrent state, and
the refusals that do not depend on the family.

Each decoder layer of a hybrid family implements `before_attention(x, positions)`,
`attend(step, inputs)` and `after_attention(x, out, rows)`; an attention layer reads its KV
cache (index among the attention layers), a recurrent layer its state slots (index among the
recurrent layers, `step.recurrent`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from jackfield.contracts.attention import StepContext
from jackfield.contracts.model import ModelFamily
from jackfield.contracts.recurrent import RecurrentStateSpec

RECURRENT_LAYER_TYPE = "linear_attention"  # transformers' name for GDN and Mamba layers alike
ATTENTION_LAYER_TYPE = "full_attention"


def layer_type_problems(types: Sequence[object] | None, num_layers: int) -> list[str]:
    """Why a hybrid config's `layer_types` cannot be served (empty: it can)."""
    if types is None:
        return []
    types = list(types)
    if len(types) != num_layers:
        return [f"layer_types has {len(types)} entries for {num_layers} layers"]
    unknown = sorted({str(t) for t in types} - {RECURRENT_LAYER_TYPE, ATTENTION_LAYER_TYPE})
    if unknown:
        return [f"layer_types {unknown} are not supported (this family serves {ATTENTION_LAYER_TYPE} and "
                f"{RECURRENT_LAYER_TYPE} layers)"]
    return []


def refuse_unsupported(problems: list[str], arch: str) -> None:
    """Every reason `arch`'s config.json cannot be served, at once (as granite_arch's)."""
    if problems:
        raise ValueError(f"config.json ({arch}): unsupported settings: " + "; ".join(problems))


class HybridDecoderStack(ModelFamily):
    """`model.layers[i]` implements the three pieces; `model.norm` the final norm."""

    model: nn.Module

    def before_attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model.layers[i].before_attention(x, positions)

    def attend(self, i: int, step: StepContext, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.model.layers[i].attend(step, inputs)

    def after_attention(self, i: int, x: torch.Tensor, attn_out: torch.Tensor,
                        output_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.layers[i].after_attention(x, attn_out, output_rows)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)


def layer_indices(types: Sequence[str]) -> list[int]:
    """Per layer: its index among the layers of its own type (KV cache or recurrent state)."""
    seen = {RECURRENT_LAYER_TYPE: 0, ATTENTION_LAYER_TYPE: 0}
    out = []
    for t in types:
        out.append(seen[t])
        seen[t] += 1
    return out


def allocate_recurrent_states(specs: Sequence[RecurrentStateSpec], num_slots: int,
                              device: torch.device | str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The slot pool: per recurrent layer, conv windows [slots, C, K - 1] and states
    [slots, *state_shape] (zeros; a request starting from zero never reads its slot)."""
    conv = [torch.zeros(num_slots, s.conv_channels, s.conv_kernel - 1, dtype=s.conv_dtype, device=device)
            for s in specs]
    states = [torch.zeros(num_slots, *s.state_shape, dtype=s.state_dtype, device=device) for s in specs]
    return conv, states
