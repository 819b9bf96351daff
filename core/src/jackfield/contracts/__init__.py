"""The contracts between the engine and its backends: data records and small ABCs only."""

from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionOutput,
    AttentionRequirements,
    Availability,
)
from jackfield.contracts.drafter import (
    Drafter,
    DrafterOptions,
    DraftProposal,
    combined_lookahead,
    exportable_tokens,
)
from jackfield.contracts.kv_connector import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorContext,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVCoverageSpec,
    ScheduledRequest,
    TransferResult,
)
from jackfield.contracts.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingParams

__all__ = [
    "AttentionBackend",
    "AttentionCapabilities",
    "AttentionImpl",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionOutput",
    "AttentionRequirements",
    "Availability",
    "ConnectorMetadata",
    "ConnectorRequest",
    "DraftProposal",
    "Drafter",
    "DrafterOptions",
    "KVConnectorContext",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVCoverageSpec",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "ScheduledRequest",
    "TransferResult",
    "combined_lookahead",
    "exportable_tokens",
]
