"""One engine step on the device: stage inputs, build attention metadata once, forward, sample.

The runner owns what the device holds for the model: the KV cache (sized from the budget) and the
CUDA graphs of decode steps and of prefill pieces, recorded at start-up where they apply, and the
KV connector's worker side: the step's loads start before the forward, each layer waits for its
loads before `attend` and hands its KV to the connector's save after, a model drafter's caches
are handed over once it ran, and the saves are waited for at the step's end. Logits
are computed only for rows that sample (the last row of each chunk that reaches the end of its
request's known tokens); an embedding request's rows are pooled instead. A hybrid model's
recurrent layers get the step's RecurrentMetadata (built once per step) and their state slots;
after a verify step their state is rolled back to each request's last accepted token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from jackfield.attention.checks import check_slots_on_host
from jackfield.attention.kv_cache import is_mla
from jackfield.attention.metadata import slice_requests
from jackfield.config import EngineConfig
from jackfield.contracts.attention import (
    AttentionBackends,
    AttentionLayerSpec,
    AttentionMetadata,
    StepContext,
)
from jackfield.contracts.drafter import ChainDrafter, ModelDrafter
from jackfield.contracts.kv_connector import ConnectorMetadata, KVConnectorWorker, TransferResult
from jackfield.contracts.model import LayerHooks, LayerTaps, ModelFamily
from jackfield.contracts.recurrent import RecurrentStep
from jackfield.contracts.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingParams
from jackfield.distributed.cp_common import parallel_state
from jackfield.distributed.dcp import DCPLayout, dcp_metadata
from jackfield.engine.block_table import BlockTableRows
from jackfield.engine.cpu_threads import CpuThreads
from jackfield.engine.cuda_graphs import DecodeGraphs
from jackfield.engine.draft_graphs import DraftGraphs, GreedyDrafting
from jackfield.engine.drafting import DraftLimits, Span, draft_in_step
from jackfield.engine.kv_cache import KVCache
from jackfield.engine.piecewise_graphs import PiecewiseGraphs
from jackfield.engine.recurrent_state import RecurrentStates
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.engine.sequence import Sequence
from jackfield.models.attention import StepContextBuilder
from jackfield.models.embedding import pool
from jackfield.models.kv_scales import KVScalePlan
from jackfield.ops.staging import async_tensor_h2d, host_empty, host_single_threaded
from jackfield.sampling.filters import filter_cutoffs
from jackfield.sampling.processors import apply_processors, bias_and_mask_from_params, penalties_from_rows
from jackfield.sampling.sample import triton_importable
from jackfield.sampling.speculative import NO_TOKEN, greedy_accept, rejection_verify, target_probabilities

PROMPT_LOGPROB_ROWS = 1024  # prompt rows scored at once: bounds their float32 logits


@dataclass(frozen=True)
class StepResult:
    token_ids: list[list[int]]  # per sampling chunk, in chunk order: its new tokens (1 + accepted drafts)
    logprobs: list[list[dict[int, float]] | None]  # per sampling chunk: one dict per new token
    embeddings: list[torch.Tensor]  # one [hidden] float32 per pooling chunk, in chunk order
    # (request, first position, entries): entry i scores prompt token first + 1 + i (prompt_logprobs)
    prompt_logprobs: list[tuple[Sequence, int, list[dict[int, float]]]]
    # A model drafter's drafts per sampling chunk: (token ids, their probabilities or None); None
    # without a model drafter.
    drafts: list[tuple[list[int], torch.Tensor | None]] | None = None


@dataclass(frozen=True)
class LaunchedStep:
    """A decode step launched under async scheduling (`ModelRunner.launch`): its sampled tokens
    are still on the device, their copy to the host queued behind the step."""

    chunks: list[ScheduledChunk]
    tokens: torch.Tensor  # [len(chunks)] int64 on the device, chunk order (-1: no finite logit)
    host_tokens: torch.Tensor  # the same, copied into pinned host memory without blocking
    copied: torch.cuda.Event | None  # recorded after that copy (None off CUDA: copied already)
    rows: dict[int, int]  # request id -> its row of `tokens`


@dataclass(frozen=True)
class InFlightIds:
    """Input rows of a step whose token a launched step sampled and the host has not read back:
    `rows` of the step's input ids take `source[index]`, on the device (a gather by row). Both
    None: rows 0 .. len(source) - 1 take `source` in order (the launched step's batch again, a
    decode batch's steady state): one kernel, and no row lists copied to the device."""

    rows: torch.Tensor | None  # int64 on the device
    source: torch.Tensor  # the launched step's sampled tokens (int64)
    index: torch.Tensor | None  # int64 on the device: each row's token in `source`

    def write(self, input_ids: torch.Tensor) -> None:
        # -1 marks a row without a finite logit: its step fails at read-back, but this step was
        # launched first and must not index the embedding out of range
        if self.rows is None or self.index is None:
            torch.clamp(self.source, min=0, out=input_ids[: self.source.shape[0]])
            return
        tokens = self.source.index_select(0, self.index).clamp(min=0)
        input_ids.index_copy_(0, self.rows, tokens.to(input_ids.dtype))


def greedy(logits: torch.Tensor) -> SamplerOutput:
    """An all-greedy step needs no sampler (nor its noise over the vocabulary): per row the first
    maximum of the finite logits, as every sampler's temperature-0 rows, and -1 for a row with
    no finite logit (the mark `_sample` gives a sampler's invalid rows). On CUDA two kernels
    (sampling/greedy_triton.py) instead of PyTorch's four over a float32 copy of the logits."""
    if logits.is_cuda and logits.dtype == torch.float32 and logits.stride(-1) == 1 and triton_importable():
        from jackfield.sampling.greedy_triton import greedy_tokens_triton

        return SamplerOutput(greedy_tokens_triton(logits))
    not_finite = -math.inf  # NaN and +-inf are never chosen
    best, tokens = torch.nan_to_num(logits, nan=not_finite, posinf=not_finite, neginf=not_finite).max(dim=1)
    return SamplerOutput(torch.where(best == -math.inf, -1, tokens))


class ConnectorLayers(LayerHooks):
    """The KV connector's per-layer calls for one step: decoder layer i reads and writes the KV
    caches j < drafter_caches.start with j % num_layers == i (contracts/model.py); `drafter_caches`
    are a model drafter's, read and written after the forward (`ModelRunner.step` waits for their
    loads before it drafts and saves them after)."""

    def __init__(self, worker: KVConnectorWorker, metadata: ConnectorMetadata, kv_caches: list[torch.Tensor],
                 num_layers: int, drafter_caches: range) -> None:
        self.worker, self.metadata, self.kv_caches = worker, metadata, kv_caches
        self.caches = [range(i, drafter_caches.start, num_layers) for i in range(num_layers)]
        self.drafter_caches = drafter_caches

    def before_attend(self, layer: int) -> None:
        for cache in self.caches[layer]:
            self.worker.wait_for_layer_load(cache)

    def before_drafter(self) -> None:
        for cache in self.drafter_caches:
            self.worker.wait_for_layer_load(cache)

    def after_attend(self, layer: int) -> None:
        for cache in self.caches[layer]:
            self.worker.save_kv_layer(cache, self.kv_caches[cache], self.metadata)


class ModelRunner:
    def __init__(self, model: ModelFamily, backends: AttentionBackends, sampler: Sampler,
                 engine: EngineConfig, max_model_len: int, device: torch.device,
                 say: Callable[[str], None], drafter: ModelDrafter | None = None,
                 num_drafter_caches: int = 0, kv_scales: KVScalePlan | None = None,
                 drafter_kv_layers: tuple[AttentionLayerSpec, ...] = (),
                 num_speculative_tokens: int = 0) -> None:
        """`drafter`: a model drafter, run inside each step (a token drafter is the engine's);
        `num_drafter_caches`: the KV caches it writes among the model's, the last ones (its MTP
        layers'); `drafter_kv_layers`: those of its own layers (`ModelDrafter.load`), allocated
        after the model's. `kv_scales`: the fp8 caches' scales (preflight's plan; None: no fp8 cache).
        `num_speculative_tokens`: the drafter's k, any kind (0: none); verify steps of k + 1 rows
        a request get CUDA graphs of their own."""
        self.model, self.backends, self.sampler, self.device = model, backends, sampler, device
        # the thread count of CPU steps (the Engine's warm-up measures it under "auto")
        self.cpu_threads = CpuThreads.from_config(engine.cpu_threads) if device.type == "cpu" else None
        self.drafter = drafter
        # the target layers whose inputs the drafter reads, collected by every forward
        self.tap_layers = drafter.tap_layers if drafter is not None else ()
        if drafter is not None:
            assert engine.block_size is not None  # the Engine resolves it first
            self.draft_limits = DraftLimits(drafter.num_speculative_tokens, max_model_len, engine.block_size,
                                            drafter.extra_block_rows)
        self.capabilities = model.capabilities
        groups = parallel_state()
        # Under decode context parallel this rank holds 1/dcp of each request's KV (dcp.py).
        self.dcp = (DCPLayout(groups.dcp_rank, groups.dcp_size, groups.dcp_interleave)
                    if groups.dcp_size > 1 else None)
        self.dcp_prefill_metadata = backends.prefill.metadata_builder()  # a DCP step's prefill requests
        self.kv_layers = [*model.kv_cache_layers, *drafter_kv_layers]  # every KV cache, in StepContext order
        num_drafter_caches += len(drafter_kv_layers)
        self.kv = KVCache.allocate(self.kv_layers, engine, max_model_len, self.capabilities.dtype, device,
                                   groups.dcp_size)
        self.kv_caches, self.block_size, self.groups = self.kv.layer_caches, engine.block_size, self.kv.groups
        # every request's block tables, as the block manager keeps them (the Engine hands it this)
        self.block_tables = BlockTableRows(len(self.groups.windows), engine.max_num_seqs,
                                           -(-max_model_len // engine.block_size))
        # Per KV cache: an fp8 cache's scales, static tensors written in place (CUDA graphs read
        # them by address); the Engine arms calibration once start-up's own steps are done.
        self.kv_scales = fp8_kv_scales(self.kv_layers, kv_scales, self.capabilities.num_layers, device)
        self.calibrate_at_next_step = False
        self.drafter_caches = range(len(self.kv_caches) - num_drafter_caches, len(self.kv_caches))
        self.contexts = StepContextBuilder(backends, self.kv_layers, self.groups.layer_group)
        specs = model.recurrent_state_layers
        # one slot per running request, and one that padded rows of replayed decode steps write
        self.recurrent = RecurrentStates(specs, engine.max_num_seqs + 1, device) if specs else None
        self.decode_graphs_off = self._decode_graphs_off_reason(engine)
        self.prefill_graphs_off = self._prefill_graphs_off_reason(engine)
        # a hybrid model's verify steps run eagerly (per-row states for the rollback)
        verify_rows = 1 + num_speculative_tokens if self.recurrent is None else 1
        self.graphs = (None if self.decode_graphs_off
                       else self._capture_decode(engine, max_model_len, verify_rows, say))
        self.pieces = None if self.prefill_graphs_off else self._capture_pieces(engine, say)
        # a chain drafter's drafting after a replayed decode step (not per DCP rank's layout)
        self.draft_graphs = None
        if self.graphs is not None and isinstance(drafter, ChainDrafter) and self.dcp is None:
            self.draft_graphs = self._capture_drafting(drafter, say)
        self.connector: KVConnectorWorker | None = None  # the KV connector's worker side (Engine sets it)

    def connector_finished(self) -> TransferResult:
        """The connector's transfers finished (or failed) since the last call."""
        assert self.connector is not None
        return self.connector.get_finished()

    def transfer(self, metadata: ConnectorMetadata) -> None:
        """A step with nothing to compute: only the connector's loads and saves start."""
        assert self.connector is not None
        self.connector.start_load_kv(metadata, self.kv_caches)
        self.connector.wait_for_save()

    def _layer_hooks(self, metadata: ConnectorMetadata | None) -> ConnectorLayers | None:
        if self.connector is None or metadata is None:
            return None
        self.connector.start_load_kv(metadata, self.kv_caches)
        return ConnectorLayers(self.connector, metadata, self.kv_caches, self.capabilities.num_layers,
                               self.drafter_caches)

    def _graphs_off_reason(self, engine: EngineConfig) -> str | None:
        """What rules out every CUDA graph of the model's forward."""
        caps = self.capabilities
        if self.device.type != "cuda":
            return f"the device is {self.device.type}"
        if not engine.cuda_graphs:
            return "engine.cuda_graphs = false"
        if parallel_state().tp_size > 1:
            return "tensor parallel steps run eagerly (their collectives are not recorded yet)"
        if not caps.causal:
            return "the model is bidirectional (no decode steps)"
        if not caps.cuda_graph_safe:
            return (f"{type(self.model).__name__} cannot be recorded here (a host sync in its forward, "
                    "e.g. MoE experts without bf16 grouped matmuls on compute capability >= 9.0)")
        return None

    def _decode_graphs_off_reason(self, engine: EngineConfig) -> str | None:
        """Why decode steps run eagerly (None: they are replayed from CUDA graphs)."""
        reason = self._graphs_off_reason(engine)
        if reason is None and self.backends.decode.capabilities.cuda_graph == "never":
            return f"decode backend {self.backends.decode.name} declares cuda_graph = never"
        return reason

    def _prefill_graphs_off_reason(self, engine: EngineConfig) -> str | None:
        """Why prefill and mixed steps run eagerly (None: their pieces between attention calls
        are replayed from CUDA graphs; attention itself always runs eagerly)."""
        reason = self._graphs_off_reason(engine)
        if reason is None and engine.prefill_graph_max_tokens == 0:
            return "engine.prefill_graph_max_tokens = 0"
        if reason is None and self.recurrent is not None:  # attend's output differs by layer kind
            return (f"{type(self.model).__name__} has recurrent layers (prefill pieces are recorded for "
                    "attention-only models)")
        return reason

    def _capture_decode(self, engine: EngineConfig, max_model_len: int, verify_rows: int,
                        say: Callable[[str], None]) -> DecodeGraphs:
        # selection checked that the decode backend serves verify_rows rows a request
        graphs = DecodeGraphs(self.model, self.kv_caches, self.kv_scales, self.contexts,
                              self.block_tables, self.kv.num_blocks, self.block_size, max_model_len,
                              engine.max_num_seqs, self.device, query_lens=tuple(sorted({1, verify_rows})),
                              recurrent=self.recurrent, tap_layers=self.tap_layers)
        try:
            graphs.capture(say)
        except RuntimeError as exc:  # e.g. a host sync in a backend's decode path
            raise RuntimeError(f"recording decode CUDA graphs with attention backend "
                               f"{self.backends.decode.name} failed ({exc}); set engine.cuda_graphs = false "
                               "to decode eagerly") from exc
        return graphs

    def _capture_drafting(self, drafter: ChainDrafter, say: Callable[[str], None]) -> DraftGraphs:
        assert self.graphs is not None
        graphs = DraftGraphs(self.graphs, drafter, self.sampler, self.capabilities.vocab_size,
                             self.draft_limits)
        try:
            graphs.capture(say)
        except RuntimeError as exc:
            raise RuntimeError(f"recording the {drafter.name} drafter's CUDA graphs failed ({exc}); set "
                               "engine.cuda_graphs = false to decode eagerly") from exc
        return graphs

    def _capture_pieces(self, engine: EngineConfig, say: Callable[[str], None]) -> PiecewiseGraphs:
        max_tokens = min(engine.max_num_batched_tokens, engine.prefill_graph_max_tokens)
        pieces = PiecewiseGraphs(self.model, max_tokens, self.device)
        try:
            pieces.capture(say)
        except RuntimeError as exc:  # a failed body makes capture_end raise its own error: name the first
            cause = exc.__context__ or exc
            raise RuntimeError(f"recording prefill CUDA graphs of {type(self.model).__name__} up to "
                               f"{max_tokens} tokens failed ({cause}); lower "
                               "engine.prefill_graph_max_tokens (or engine.gpu_memory_fraction) if memory "
                               "ran out, or set it to 0 to run prefill steps eagerly") from exc
        return pieces

    def _h2d(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return async_tensor_h2d(data, dtype, self.device, pin_memory=True)

    def _metadata(self, chunks: list[ScheduledChunk],
                  ) -> tuple[list[AttentionMetadata], list[int], torch.Tensor]:
        """(metadata per KV cache group, input ids, positions) for the step's flat batch."""
        input_ids = [token for chunk in chunks for token in chunk.input_ids]
        spans = [Span(c.seq, c.seq.num_computed, c.num_tokens) for c in chunks]
        # decodes first
        per_group, positions, _ = self._span_metadata(spans, sum(c.is_decode for c in chunks))
        return per_group, input_ids, positions

    def _span_metadata(self, spans: list[Span], num_decodes: int, causal: bool = True,
                       ) -> tuple[list[AttentionMetadata], torch.Tensor, torch.Tensor | None]:
        """(metadata per KV cache group, positions [T] on the host, the slots [groups, T] on the
        host, None under DCP) of rows at each span's positions, the first `num_decodes` spans
        being decodes; `causal` False: every row sees
        all its request's keys (a drafter's block; the model's own rows follow the model). The
        groups' metadata differ only in block tables and slots."""
        query_start = [0]
        seq_lens: list[int] = []
        for span in spans:
            query_start.append(query_start[-1] + span.count)
            seq_lens.append(span.start + span.count)
        qsl_cpu = torch.tensor(query_start, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        # Per row: its request and position (vectorized: a prefill chunk has thousands of rows).
        q_lens = qsl_cpu.diff().long()
        row_req = torch.repeat_interleave(torch.arange(len(spans)), q_lens)
        positions = torch.arange(query_start[-1]) + (seq_lens_cpu.long() - q_lens - qsl_cpu[:-1])[row_req]
        shared = dict(
            query_start_loc=self._h2d(qsl_cpu, torch.int32),
            seq_lens=self._h2d(seq_lens_cpu, torch.int32),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=max(s.count for s in spans),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            num_decode_tokens=query_start[num_decodes],
            causal=self.capabilities.causal and causal,
        )
        bs = self.block_size
        tables = self.block_tables.gather([s.seq.table_row for s in spans])  # type: ignore[misc]
        if self.dcp is not None:  # decode rows over this rank's keys, prefills over the gathered context
            per_rank = [dcp_metadata(self.dcp, bs, table.long(), row_req, positions, qsl_cpu, num_decodes,
                                     self._h2d, self.dcp_prefill_metadata.build) for table in tables]
            return per_rank, positions, None
        slots = tables[:, row_req, positions // bs].long() * bs + positions % bs  # [groups, rows]
        per_group = []
        for table, group_slots in zip(tables, slots, strict=True):
            slot_mapping = self._h2d(group_slots, torch.int64)
            check_slots_on_host(slot_mapping, group_slots, self.kv.num_blocks * bs)  # no device read
            per_group.append(AttentionMetadata(block_table=self._h2d(table, torch.int32),  # type: ignore[arg-type]
                                               slot_mapping=slot_mapping, **shared))
        return per_group, positions, slots

    def _draft_attention(self, spans: list[Span], num_decodes: int,
                         causal: bool = True) -> tuple[StepContext, torch.Tensor]:
        """A model drafter's rows: their step context and positions on the device."""
        with host_single_threaded():
            per_group, positions, _ = self._span_metadata(spans, num_decodes, causal)
            return self.contexts.build(self.kv_caches, per_group), self._h2d(positions, torch.int64)

    def _draft_chain_attention(self, drafts: list[list[Span]],
                               ) -> list[Callable[[], tuple[StepContext, torch.Tensor]]]:
        """A model drafter's chain (drafting.ChainAttentionFor): the rows of every draft (one row
        per span) in one metadata pass and one copy to the device, sliced per draft. A draft's
        context is built when it runs: a backend's builder may reuse its buffers per build."""
        if self.dcp is not None:  # a DCP layout is per batch: each draft's own pass
            return [functools.partial(self._draft_attention, spans, len(spans)) for spans in drafts]
        every = [span for spans in drafts for span in spans]
        with host_single_threaded():
            per_group, positions, slots = self._span_metadata(every, len(every))
            positions = self._h2d(positions, torch.int64)
        assert slots is not None  # not under DCP
        capacity = self.kv.num_blocks * self.block_size
        # the drafter's group last: the kernels' slot check remembers the last mapping checked
        drafter_group = self.groups.layer_group[self.drafter_caches.start]
        groups = sorted(range(len(per_group)), key=lambda g: g == drafter_group)

        def built(parts: list[AttentionMetadata], rows: torch.Tensor, start: int,
                  ) -> tuple[StepContext, torch.Tensor]:
            # Each draft's slot_mapping is a slice (a tensor of its own): checked on the host
            # here, or the KV insert's check would read it from the device, a sync per draft.
            for g in groups:
                check_slots_on_host(parts[g].slot_mapping, slots[g, start : start + rows.shape[0]], capacity)
            # a chain's rows are one per request: too few for the thread pool's barriers to cost
            return self.contexts.build(self.kv_caches, parts), rows

        chain: list[Callable[[], tuple[StepContext, torch.Tensor]]] = []
        start = 0
        for spans in drafts:
            end = start + len(spans)
            parts = [slice_requests(common, start, end, is_decode=True) for common in per_group]
            chain.append(functools.partial(built, parts, positions[start:end], start))
            start = end
        return chain

    def _sampling_metadata(self, sampling: list[ScheduledChunk]) -> SamplingMetadata:
        """One row per sampled position: a verify chunk's row i samples position num_tokens + i
        (its last row is the bonus token's distribution)."""
        rows = [(c.seq, c.seq.num_tokens_ahead + i) for c in sampling for i in range(1 + c.num_drafts)]
        params = [seq.params for seq, _ in rows]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        vocab = self.capabilities.vocab_size
        bias, allowed = bias_and_mask_from_params(params, vocab, self.device)
        penalties = None
        if any(p.penalized for p in params):
            # A verify row's penalties count the drafts before it as generated (as if they had
            # been emitted one step at a time).
            generated = [c.seq.output_ids + c.seq.draft_ids[:i]
                         for c in sampling for i in range(1 + c.num_drafts)]
            prompts = [seq.token_ids[: seq.prompt_len] for seq, _ in rows]
            penalties = penalties_from_rows(params, prompts, generated, vocab, self.device)
        return SamplingMetadata(
            temperature=self._h2d([p.temperature for p in params], torch.float32),
            top_k=self._h2d([max(p.top_k, 0) for p in params], torch.int64),
            top_p=self._h2d([p.top_p for p in params], torch.float32),
            min_p=self._h2d([p.min_p for p in params], torch.float32),
            seeds=self._h2d([seq.seed for seq, _ in rows], torch.int64),
            positions=self._h2d([position for _, position in rows], torch.int64),
            max_num_logprobs=max(asked) if asked else None,
            logit_bias=bias,
            allowed_token_mask=allowed,
            penalties=penalties,
        )

    @torch.no_grad()  # not inference_mode: backends may key checks on a tensor's version counter
    def forward(self, chunks: list[ScheduledChunk], output_rows: list[int] | None = None,
                hooks: LayerHooks | None = None, recurrent: RecurrentStep | None = None,
                taps: LayerTaps | None = None, in_flight: InFlightIds | None = None) -> torch.Tensor:
        """Final hidden states of `output_rows` of the step's flat batch (all rows when None),
        writing every row's KV (`hooks` around each layer's attention; `recurrent`: a hybrid
        model's recurrent layers' part of the step; `taps` collects layer inputs over every row;
        `in_flight` writes the input tokens still on the device)."""
        calibrate, self.calibrate_at_next_step = self.calibrate_at_next_step, False
        with host_single_threaded():
            per_group, input_ids, positions = self._metadata(chunks)
            context = self.contexts.build(self.kv_caches, per_group, kv_scales=self.kv_scales,
                                          calibrate_kv_scales=calibrate)
            if recurrent is not None:
                context = dataclasses.replace(context, recurrent=recurrent)
            rows = None if output_rows is None else self._h2d(output_rows, torch.int64)
            ids, pos = self._h2d(input_ids, torch.int64), self._h2d(positions, torch.int64)
            if in_flight is not None:
                in_flight.write(ids)
        if self.pieces is not None and self.pieces.fits(len(input_ids)):
            hidden = self.pieces.run(ids, pos, context, hooks, taps)  # every row (a graph has no row choice)
            return hidden if rows is None else hidden[rows]
        return self.model(ids, pos, context, rows, taps=taps, hooks=hooks)

    def step(self, chunks: list[ScheduledChunk], connector_metadata: ConnectorMetadata | None = None,
             ) -> StepResult:
        """The step's forward, sampling and drafting."""
        with self._step_threads():
            return self._step(chunks, connector_metadata)

    def _step_threads(self) -> contextlib.AbstractContextManager[None]:
        """A step's device work at the engine's thread count on the CPU (engine/cpu_threads.py;
        torch's pool size restored after): synchronous and pipelined steps alike."""
        return contextlib.nullcontext() if self.cpu_threads is None else self.cpu_threads.run_at()

    @torch.no_grad()  # not inference_mode: backends may key checks on a tensor's version counter
    def _step(self, chunks: list[ScheduledChunk], connector_metadata: ConnectorMetadata | None = None,
              ) -> StepResult:
        sampling = [c for c in chunks if c.samples and c.seq.pooling is None]
        hooks = self._layer_hooks(connector_metadata)
        recurrent = None  # a hybrid model's eager step: its recurrent layers' part (a replay has its own)
        taps = LayerTaps(self.tap_layers, self.capabilities.num_layers) if self.tap_layers else None
        # a calibrating step runs eagerly: its layers set their scales before writing KV
        recorded = None  # the rows a request of the graph that replays this step
        if self.graphs is not None and not self.calibrate_at_next_step:
            recorded = self.graphs.query_len(chunks)
        if recorded is not None:
            assert self.graphs is not None
            layers = range(self.capabilities.num_layers) if hooks is not None else range(0)
            for layer in layers:  # a replayed step is one piece: every layer's hooks around it
                hooks.before_attend(layer)  # type: ignore[union-attr]
            with host_single_threaded():  # the replay itself is GPU work
                # every row is a sampling decode or verify row (query_len() checked it)
                every_row = hidden = self.graphs.run(chunks, recorded, taps)
            for layer in layers:
                hooks.after_attend(layer)  # type: ignore[union-attr]
            embeddings: list[torch.Tensor] = []
            scored: list[tuple[ScheduledChunk, torch.Tensor]] = []
        else:
            # The last layer finishes only the rows that sample (a prefill's last token), are
            # pooled (an embedding request's rows) or score prompt tokens: its output projection
            # and MLP skip the rest.
            # A step that samples nothing (a middle prefill chunk) runs whole: its output is unused.
            # A model drafter reads every row's hidden state.
            rows = _output_rows(chunks)
            some = 0 < len(rows) < sum(c.num_tokens for c in chunks) and self.drafter is None
            if self.recurrent is not None:
                with host_single_threaded():
                    recurrent = self.recurrent.step(chunks)
            every_row = self.forward(chunks, rows if some else None, hooks, recurrent, taps)
            hidden = every_row if len(rows) == every_row.shape[0] else every_row[rows]
            hidden, embeddings, scored = self._split_rows(chunks, hidden)
        prompt_logprobs = [(c.seq, c.prompt_logprob_positions.start, self._prompt_logprobs(c, h))
                           for c, h in scored]
        if not sampling:
            drafts = self._draft(chunks, every_row, [], taps, hooks, None)
            self._end_saves(connector_metadata)
            return StepResult([], [], embeddings, prompt_logprobs, drafts)
        logits = self.model.compute_logits(hidden)  # one row per sampled position
        tokens, out, metadata = self._sample(logits, sampling)
        greedy_drafting = None
        if (metadata is None and recorded is not None and self.draft_graphs is not None
                and self.recurrent is None):
            # plain greedy (a hybrid model's steps keep the path that rolls its states back): the
            # drafting graph counts each request's accepted drafts on the device and replays
            # behind the verify, so one read-back brings the tokens and the drafts
            if hooks is not None:
                hooks.before_drafter()
            with host_single_threaded():
                greedy_drafting = self.draft_graphs.run_greedy(chunks, recorded, tokens)
            token_ids = _checked(greedy_drafting.token_ids)
        else:
            token_ids = _checked(tokens.tolist())  # the step's one host sync (a random verify adds one)
        first_row = list(itertools.accumulate((1 + c.num_drafts for c in sampling), initial=0))
        emitted = [greedy_accept(c.seq.draft_ids[: c.num_drafts], token_ids[first_row[i] : first_row[i + 1]])
                   for i, c in enumerate(sampling)]
        randomly = [i for i, c in enumerate(sampling) if c.num_drafts and c.seq.params.temperature > 0]
        if randomly:
            assert metadata is not None  # a sampled row is never plain greedy
            verified = self._rejection_verify([sampling[i] for i in randomly],
                                              [first_row[i] for i in randomly], logits, tokens, metadata)
            for i, new_tokens in zip(randomly, verified, strict=True):
                emitted[i] = new_tokens
        if recurrent is not None and recurrent.metadata.keep_requests.numel():
            # the recurrent layers' state after each verify chunk's last accepted token
            self.recurrent.roll_back(recurrent, chunks,  # type: ignore[union-attr]
                                     [len(emitted[i]) - 1 for i, c in enumerate(sampling) if c.num_drafts])
        logprobs: list[list[dict[int, float]] | None] = [None] * len(sampling)
        if out.logprobs is not None and out.logprob_token_ids is not None:
            ids, values = out.logprob_token_ids.tolist(), out.logprobs.tolist()
            # As vLLM: the new token's own logprob too (a sampled token may be outside the top k).
            asking = [i for i, c in enumerate(sampling) if c.seq.params.logprobs is not None]
            rows = [first_row[i] + j for i in asking for j in range(len(emitted[i]))]
            new = [t for i in asking for t in emitted[i]]
            chosen = iter(torch.log_softmax(logits[self._h2d(rows, torch.int64)].float(), dim=-1)
                          .gather(1, self._h2d(new, torch.int64).unsqueeze(1)).squeeze(1).tolist())
            for i in asking:  # token j of a verify chunk came from the chunk's row j
                k = sampling[i].seq.params.logprobs
                logprobs[i] = [{**dict(zip(ids[r][:k], values[r][:k], strict=True)), token: next(chosen)}
                               for r, token in zip(range(first_row[i], first_row[i] + len(emitted[i])),
                                                   emitted[i], strict=True)]
        drafts = self._draft(chunks, every_row, emitted, taps, hooks, recorded, greedy_drafting)
        self._end_saves(connector_metadata)
        return StepResult(emitted, logprobs, embeddings, prompt_logprobs, drafts)

    def launch(self, chunks: list[ScheduledChunk], previous: LaunchedStep | None) -> LaunchedStep:
        """Async scheduling's first half of a decode step (one sampling row a request; the
        engine's `_pipelines` chose the step): stage it, replay its graph or run it eagerly, sample
        into a device tensor and queue the tokens' copy to the host; nothing waits for the device.
        A request whose input token `previous` sampled takes it from `previous.tokens` on the
        device. `finish` reads the tokens back."""
        with self._step_threads():
            return self._launch(chunks, previous)

    @torch.no_grad()
    def _launch(self, chunks: list[ScheduledChunk], previous: LaunchedStep | None) -> LaunchedStep:
        in_flight = None
        moved = [(row, c.seq.request_id) for row, c in enumerate(chunks) if c.seq.num_in_flight]
        if moved:
            assert previous is not None, "a token in flight comes from the launched step"
            rows, index = [row for row, _ in moved], [previous.rows[rid] for _, rid in moved]
            if rows == index and len(rows) == previous.tokens.shape[0]:  # every row takes its own again
                in_flight = InFlightIds(None, previous.tokens, None)
            else:
                in_flight = InFlightIds(self._h2d(rows, torch.int64), previous.tokens,
                                        self._h2d(index, torch.int64))
        q = self.graphs.query_len(chunks) if self.graphs is not None else None
        if q is not None:
            assert self.graphs is not None
            with host_single_threaded():  # the replay itself is GPU work
                hidden = self.graphs.run(chunks, q, in_flight=in_flight)
        else:
            hidden = self.forward(chunks, in_flight=in_flight)
        tokens = self._sample(self.model.compute_logits(hidden), chunks)[0]
        host = host_empty(tuple(tokens.shape), tokens.dtype)  # a fresh buffer: nothing rewrites it
        host.copy_(tokens, non_blocking=True)
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return LaunchedStep(chunks, tokens, host, copied, {c.seq.request_id: i for i, c in enumerate(chunks)})

    def finish(self, launched: LaunchedStep) -> list[int]:
        """A launched step's tokens on the host, one per chunk (waits for their copy)."""
        if launched.copied is not None:
            launched.copied.synchronize()
        return _checked(launched.host_tokens.tolist())

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledChunk],
                ) -> tuple[torch.Tensor, SamplerOutput, SamplingMetadata | None]:
        """(each row's token on the device, -1 where no logit was finite; the sampler's output;
        the sampling metadata, None for an all-greedy step)."""
        metadata = None
        if all(_plain_greedy(c.seq.params) for c in sampling):
            out = greedy(logits)
        else:
            with host_single_threaded():
                metadata = self._sampling_metadata(sampling)
            out = self.sampler.sample(logits, metadata)
        tokens = out.token_ids
        if out.invalid_rows is not None:
            tokens = torch.where(out.invalid_rows, -1, tokens)
        return tokens, out, metadata

    def _end_saves(self, metadata: ConnectorMetadata | None) -> None:
        """The model drafter's caches go to the connector's save once the drafter wrote them; then
        the step's saves are waited for."""
        if self.connector is None:
            return
        if metadata is not None:
            for cache in self.drafter_caches:
                self.connector.save_kv_layer(cache, self.kv_caches[cache], metadata)
        self.connector.wait_for_save()

    def _draft(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, emitted: list[list[int]],
               taps: LayerTaps | None, hooks: ConnectorLayers | None, recorded: int | None,
               greedy_drafting: GreedyDrafting | None = None,
               ) -> list[tuple[list[int], torch.Tensor | None]] | None:
        """The model drafter's part of the step (engine/drafting.py; `hidden` and `taps`: every
        row's), replayed from the drafting graphs after a replayed step (`recorded`: its rows a
        request) where they serve it; a plain greedy step's drafts were read back with its
        tokens (`greedy_drafting`): each request's at its accepted count."""
        if self.drafter is None:
            return None
        if greedy_drafting is not None:
            return greedy_drafting.drafts(emitted)
        if hooks is not None:
            hooks.before_drafter()
        if recorded is not None and self.draft_graphs is not None:
            with host_single_threaded():
                drafts = self.draft_graphs.run(chunks, recorded, emitted)
            if drafts is not None:
                return drafts
        states = [] if taps is None else [s for s in taps.states if s is not None]
        return draft_in_step(self.drafter, self.model, self.sampler, self._draft_attention,
                             self._draft_chain_attention, self.draft_limits, chunks, hidden, emitted, states)

    def _rejection_verify(self, chunks: list[ScheduledChunk], first_rows: list[int], logits: torch.Tensor,
                          sampled: torch.Tensor, metadata: SamplingMetadata) -> list[list[int]]:
        """The new tokens of sampled (temperature > 0) verify chunks: their drafts against the
        target's distributions at those rows (bias, allowed tokens and top-k/top-p/min-p applied,
        as the sampler applies them), the bonus being the token the sampler drew at the last row."""
        m = metadata
        adjusted = apply_processors(logits, m)
        cutoff = filter_cutoffs(adjusted, m.temperature, m.top_k, m.top_p, m.min_p)
        width = max(c.num_drafts for c in chunks)
        # Row of each request's draft j (padding points at its first row: masked by NO_TOKEN).
        rows = [[first + min(j, c.num_drafts - 1) for j in range(width)]
                for c, first in zip(chunks, first_rows, strict=True)]
        index = self._h2d(rows, torch.int64).flatten()
        probs = target_probabilities(adjusted[index], m.temperature[index],
                                     None if cutoff is None else cutoff[index]).view(len(chunks), width, -1)
        drafts = [c.seq.draft_ids[: c.num_drafts] + [NO_TOKEN] * (width - c.num_drafts) for c in chunks]
        bonus = sampled[self._h2d([first + c.num_drafts for c, first in zip(chunks, first_rows, strict=True)],
                                  torch.int64)]
        # q of each draft (a model drafter's; None: every draft certain, as n-gram lookup's); padded
        # rows are masked by NO_TOKEN.
        draft_probs = None
        if any(c.seq.draft_probs is not None for c in chunks):
            draft_probs = torch.zeros_like(probs)
            for i, c in enumerate(chunks):
                assert c.seq.draft_probs is not None, "a drafter gives every sampled request q or none"
                draft_probs[i, : c.num_drafts] = c.seq.draft_probs[: c.num_drafts]
        out = rejection_verify(self._h2d(drafts, torch.int64), probs, draft_probs, bonus,
                               self._h2d([c.seq.seed for c in chunks], torch.int64),
                               self._h2d([c.seq.num_tokens for c in chunks], torch.int64))
        return [[t for t in row if t != NO_TOKEN] for row in out.tolist()]

    def _split_rows(self, chunks: list[ScheduledChunk], hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[ScheduledChunk, torch.Tensor]]]:
        """(the sampling rows of `hidden`, one pooled vector per pooling chunk, each prompt-logprobs
        chunk's scoring rows). `hidden` holds the rows `_output_rows` chose, in chunk order."""
        sample_rows: list[int] = []
        embeddings = []
        scored = []
        start = 0
        for chunk in chunks:
            if scoring := len(chunk.prompt_logprob_positions):
                scored.append((chunk, hidden[start : start + scoring]))
                start += scoring
            if chunk.samples and chunk.seq.pooling is not None:
                n = chunk.num_tokens
                embeddings.append(pool(hidden[start : start + n], [0, n], chunk.seq.pooling)[0])
                start += n
            elif chunk.samples:  # its last row, and its drafts' rows
                sample_rows += range(start, start + 1 + chunk.num_drafts)
                start += 1 + chunk.num_drafts
        return (hidden if not embeddings and not scored else hidden[sample_rows]), embeddings, scored

    def _prompt_logprobs(self, chunk: ScheduledChunk, hidden: torch.Tensor) -> list[dict[int, float]]:
        """Per scoring row: log_softmax of the raw logits at the next prompt token and the top k
        (vLLM's prompt_logprobs), in slices that bound the [rows, vocab] float32 logits."""
        seq, positions = chunk.seq, chunk.prompt_logprob_positions
        k = seq.params.prompt_logprobs
        assert k is not None
        targets = seq.token_ids[positions.start + 1 : positions.stop + 1]
        entries: list[dict[int, float]] = []
        for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[lo : lo + PROMPT_LOGPROB_ROWS])
                                         .to(torch.float32), dim=-1)
            own = self._h2d(targets[lo : lo + PROMPT_LOGPROB_ROWS], torch.int64)
            values = logprobs.gather(1, own.unsqueeze(1)).squeeze(1).tolist()
            top_values, top_ids = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
            for ids, tops, token, value in zip(top_ids.tolist(), top_values.tolist(),
                                               targets[lo : lo + PROMPT_LOGPROB_ROWS], values, strict=True):
                entries.append({**dict(zip(ids, tops, strict=True)), token: value})
        return entries


def fp8_kv_scales(layers: list[AttentionLayerSpec], plan: KVScalePlan | None, num_layers: int,
                  device: torch.device) -> list[torch.Tensor | None]:
    """Per KV cache layer j: its fp8 scales (those of decoder layer j % num_layers in `plan`; ones
    until calibrated), None for other caches."""
    scales: list[torch.Tensor | None] = []
    for j, layer in enumerate(layers):
        if layer.kv_cache_dtype != "fp8_e4m3":
            scales.append(None)
            continue
        if plan is None:
            raise ValueError("an fp8_e4m3 KV cache needs a scale plan (preflight makes one)")
        size = 1 if is_mla(layer) else 2
        values = plan.layers[j % num_layers] if plan.layers is not None else (1.0,) * size
        if len(values) != size:
            raise ValueError(f"KV cache {j} takes {size} scale(s), the plan gives {len(values)}")
        scales.append(torch.tensor(values, dtype=torch.float32, device=device))
    return scales


def _output_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Rows of the step's flat batch whose final hidden states are used: a sampling chunk's last
    row, every row of a pooling chunk (an embedding request runs whole in one step), the rows
    that score prompt tokens (first in their chunk)."""
    rows: list[int] = []
    start = 0
    for chunk in chunks:
        end = start + chunk.num_tokens
        rows += range(start, start + len(chunk.prompt_logprob_positions))
        if chunk.samples:
            rows += range(start if chunk.seq.pooling is not None else end - 1 - chunk.num_drafts, end)
        start = end
    return rows


def _checked(token_ids: list[int]) -> list[int]:
    if -1 in token_ids:
        raise FloatingPointError("the model produced no finite logit for a request (NaN/inf activations)")
    return token_ids


def _plain_greedy(params: SamplingParams) -> bool:
    """Argmax of the raw logits is the whole answer (no logprobs, bias, allowed-token list or penalty)."""
    return (
        params.temperature == 0
        and params.logprobs is None
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.penalized
    )
