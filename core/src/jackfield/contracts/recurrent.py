"""Recurrent layers (Gated DeltaNet, Mamba2): the state each request keeps, and a step's metadata.

A recurrent layer keeps a fixed-size state per request instead of a KV cache that grows with the
sequence: a convolution window (the last K - 1 inputs of its short causal conv1d) and the
recurrence's state (the gated delta rule's [H, Dk, Dv] matrix, Mamba2's [H, P, N]). The engine
keeps them in a slot pool beside the paged KV cache groups: a request holds one slot from its
admission to its release; a preempted request gives it back and starts from a zero state when it
is recomputed. Every recurrent layer of a step reads one `RecurrentMetadata`, built once.

Flat batch layout, as attention's (decodes first): request b owns rows
query_start_loc[b] .. query_start_loc[b + 1]; `padded_rows[b, j]` is the flat row of its j-th
query (T, one past the last row, where b has fewer than max_query_len rows, so a gather from x
with a zero row appended pads with zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

RecurrentKind = Literal["gated_delta_net", "mamba2"]
RECURRENT_KINDS: tuple[str, ...] = ("gated_delta_net", "mamba2")


@dataclass(frozen=True)
class RecurrentStateSpec:
    """One recurrent layer's per-request state: a conv window [conv_channels, conv_kernel - 1]
    in `conv_dtype` and a recurrence state of `state_shape` in `state_dtype` (float32: the
    recurrences accumulate over the whole sequence)."""

    kind: RecurrentKind
    conv_channels: int
    conv_kernel: int
    state_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    state_dtype: torch.dtype = torch.float32

    def problems(self) -> list[str]:
        """Every reason the engine cannot keep this state (empty: it can)."""
        found = []
        if self.kind not in RECURRENT_KINDS:
            found.append(f"recurrent layer kind {self.kind!r} is not one of "
                         f"{', '.join(RECURRENT_KINDS)}")
        if self.state_dtype != torch.float32:
            found.append(f"recurrent state dtype {self.state_dtype} is not supported: the state is kept in "
                         "float32 (it accumulates over the whole sequence)")
        if self.conv_kernel < 2 or self.conv_channels < 1 or not self.state_shape:
            found.append(f"recurrent layer shapes out of range: conv {self.conv_channels} x "
                         f"{self.conv_kernel}, state {self.state_shape}")
        return found


@dataclass(frozen=True)
class RecurrentMetadata:
    """What every recurrent layer of one step shares (built once per step)."""

    query_start_loc: torch.Tensor  # int64 [B + 1]
    query_lens: torch.Tensor  # int64 [B]
    state_slots: torch.Tensor  # int64 [B]: each request's slot in the state pool
    has_state: torch.Tensor  # bool [B]: the slot holds the request's earlier tokens (else start at zero)
    padded_rows: torch.Tensor  # int64 [B, max_query_len]: flat rows, T past a request's rows
    # int64 [T]: each flat row's place in the padded layout flattened (b * max_query_len + j), so
    # outputs come back in flat order by a gather (no boolean mask: no host sync)
    valid_rows: torch.Tensor
    # per conv kernel size K among the step's layers: [B, K - 1] positions of each request's new
    # window in the sequence [old window ‖ its padded rows] (the window after its last row)
    conv_windows: dict[int, torch.Tensor]
    # requests (indices < B) whose state after each of their rows is kept (speculative verify
    # chunks: the state is rolled back to the last accepted row after sampling)
    keep_requests: torch.Tensor  # int64 [V]
    num_tokens: int
    max_query_len: int
    # rows of the longest kept request (0: none kept): the length L of the per-row states, so a
    # verify chunk beside a long prefill chunk keeps 1 + k states, not max_query_len
    kept_rows: int = 0

    @property
    def num_reqs(self) -> int:
        return int(self.state_slots.shape[0])


@dataclass
class RowStates:
    """Per recurrent layer, the states after each row of the kept requests: conv [V, L, C, K-1]
    and recurrence [V, L, *state_shape] (filled by the layers during the forward)."""

    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    state: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class RecurrentStep:
    """A step's recurrent part of StepContext: the metadata, the pool's tensors per recurrent
    layer (written in place) and the per-row states the verify chunks keep."""

    metadata: RecurrentMetadata
    conv_states: list[torch.Tensor]  # per recurrent layer: [slots, C, K - 1]
    states: list[torch.Tensor]  # per recurrent layer: [slots, *state_shape]
    rows: RowStates = field(default_factory=RowStates)
