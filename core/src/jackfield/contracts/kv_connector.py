"""The KV-connector contract: move KV between this engine and somewhere else (CPU, a peer).

A connector has two roles living in different places: the scheduler side decides what to load
and save; the worker side moves the bytes, layer by layer, overlapped with the forward pass.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from jackfield.contracts.attention import AttentionLayerSpec


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
class ConnectorRequest:
    """What a connector's scheduler side sees of a request."""

    request_id: str
    # chained hashes of the request's full blocks of verified tokens: the device prefix cache's
    # own hashes, whose chain starts at engine.prefix_hash_seed (equal seeds: equal keys)
    block_hashes: tuple[int, ...]
    num_tokens: int  # verified tokens (prompt and accepted output)


@dataclass(frozen=True)
class ScheduledRequest:
    """A request the step computes, as the connector may export it."""

    request: ConnectorRequest
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group: its block table (0: a dropped block)
    # tokens whose KV holds verified tokens once the step ran (`exportable_tokens`: never draft KV)
    num_exportable: int


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the scheduler side tells the worker side for one step (connector-defined payload)."""

    payload: dict[str, object]


@dataclass(frozen=True)
class TransferResult:
    """What the worker side finished since its last report, by request id."""

    saved: frozenset[str] = frozenset()  # every save issued for these so far is done
    loaded: frozenset[str] = frozenset()  # their external KV is in their blocks
    failed_saves: frozenset[str] = frozenset()  # some save failed: its chunks must never be read
    failed_loads: frozenset[str] = frozenset()  # their loaded blocks are invalid: the engine recomputes them


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector is built from: the factory of a `KVConnectorSpec` takes one and returns
    (KVConnectorScheduler, KVConnectorWorker)."""

    options: Mapping[str, object]  # [kv_connector] options (already passed `check_options`)
    block_size: int
    coverage: tuple[KVCoverageSpec, ...]  # per KV cache group: its block size and the model's window
    lookahead_tokens: int  # `combined_lookahead(drafters)`: draft KV a step may write past the verified
    layers: tuple[AttentionLayerSpec, ...]  # per KV cache layer (the index the worker calls take)
    layer_group: tuple[int, ...]  # per KV cache layer: its KV cache group
    kv_caches: tuple[torch.Tensor, ...]  # per KV cache layer (layers of different groups may share one)
    device: torch.device


class KVConnectorScheduler(ABC):
    """Runs in the scheduler. A load is either asynchronous or in-step, as
    `get_num_new_matched_tokens` says per request.

    Asynchronous (KV arriving from elsewhere, in its own time): the admitted request waits
    (holding its blocks) until `TransferResult.loaded` or `failed_loads` names it, while the
    others run. In-step (KV already in local memory): the request computes its remaining tokens
    in the step that loads it; the worker has each layer's blocks in place before that layer
    reads them (`wait_for_layer_load`), and must know of a failure by the `get_finished` call the
    engine makes right after the step (it then discards the request's step and recomputes)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed: int) -> tuple[int, bool]:
        """(tokens, load_async): the tokens past `num_computed` (the device prefix hit) whose KV can
        be loaded, whole blocks, never the request's last token; and whether that load is
        asynchronous (else in-step). Must not change state: the engine may not admit it."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[Sequence[int]],
                                 num_computed: int, num_external: int) -> None:
        """The request was admitted with blocks (per KV cache group) for its `num_computed`-token
        device prefix hit and the `num_external` tokens `get_num_new_matched_tokens` offered
        (0: it computes the rest itself)."""

    @abstractmethod
    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        """The step's loads and saves, once per step after scheduling."""

    @abstractmethod
    def update_connector_output(self, result: TransferResult) -> None:
        """The worker's report, handed over at the start of each step."""

    @abstractmethod
    def request_finished(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> bool:
        """True when the connector still reads the blocks: the engine frees them once a
        `TransferResult.saved` names the request."""

    def stats(self) -> dict[str, int]:
        """Counters for reports (`jackfield run --json`)."""
        return {}


class KVConnectorWorker(ABC):
    """Runs beside the model. `layer` is a KV cache layer's index (into the KV caches)."""

    @abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata, kv_caches: Sequence[torch.Tensor]) -> None:
        """Before the forward: start the step's loads (asynchronous ones may finish in a later
        step; in-step ones are waited for layer by layer)."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Before `layer` reads its cache: the step's in-step loads of `layer` are in place once
        this returns or, on a GPU, once the device's current stream reaches this point."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, metadata: ConnectorMetadata) -> None:
        """After `layer` wrote its KV: start saving what the step's metadata asks for."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: the step's saves no longer read the cache once this returns or, on
        a GPU, once the device's current stream reaches this point (blocks may then be reused)."""

    @abstractmethod
    def get_finished(self) -> TransferResult:
        """What finished (or failed) since the last call; never blocks."""
