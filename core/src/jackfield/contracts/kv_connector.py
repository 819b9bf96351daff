"""The KV-connector contract: move KV between this engine and somewhere else (CPU, a peer).

A connector has two roles living in different places: the scheduler side decides what to load
and save; the worker side moves the bytes, layer by layer, overlapped with the forward pass.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCoverageSpec:
    """Which KV a connector must hold to reproduce a request's attention.

    block_size: tokens per KV block. sliding_window: None for full attention, else the tokens a
    query sees (only the last `sliding_window - 1 + retained_extra_tokens` tokens are needed).
    retained_extra_tokens: slack kept past the window (e.g. drafter lookahead).
    Derive variants with `with_changes`, never by mutation.
    """

    block_size: int
    sliding_window: int | None = None
    retained_extra_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if self.retained_extra_tokens < 0:
            raise ValueError(f"retained_extra_tokens must be >= 0, got {self.retained_extra_tokens}")

    def with_changes(self, **changes: object) -> KVCoverageSpec:
        return dataclasses.replace(self, **changes)

    def needed_token_range(self, num_tokens: int) -> range:
        """Token positions whose KV a request of `num_tokens` tokens still needs."""
        if self.sliding_window is None:
            return range(0, num_tokens)
        keep = self.sliding_window - 1 + self.retained_extra_tokens
        return range(max(0, num_tokens - keep), num_tokens)


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the scheduler side tells the worker side for one step (connector-defined payload)."""

    payload: dict[str, object]


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> int:
        """Tokens beyond `num_computed` whose KV can be loaded from outside."""

    @abstractmethod
    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int],
                                 num_external: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata: ...

    @abstractmethod
    def request_finished(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """True when the connector still reads the blocks (the engine must not free them yet)."""


class KVConnectorWorker(ABC):
    @abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata, kv_caches: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor, metadata: ConnectorMetadata) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(request ids whose saves finished, request ids whose loads finished)."""
