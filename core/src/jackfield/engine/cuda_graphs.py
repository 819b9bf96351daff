"""Decode and verify steps replayed from CUDA graphs, as vLLM and SGLang do.

A decode step of a small model is bound by the host: hundreds of kernel launches, each behind
Python and the PyTorch dispatcher. Recording the model's forward once per batch size and
replaying it costs one launch. Capture runs at start-up, largest batch first so the smaller
graphs share its memory pool.

What a replay needs: every input lives in a static device buffer (ids, positions, slots, lengths,
block tables), written in place before each replay, and each graph keeps the step context it
was recorded with (a replay reads its tensors by address); batches are padded up to the next
captured size with rows that see no KV (seq_len 0) and write none (slot -1). The attention metadata's
Python values are upper bounds fixed at capture (max_seq_len = max_model_len), which is why only
backends that declare `cuda_graph` support (their decode path reads lengths from the device
tensors, never syncs, and accepts rows with no KV) are captured; the engine runs the rest eagerly.
The slots a replay writes are checked on the host (the kernels' own per-call check would sync).
A drafter's taps (layer inputs, `LayerTaps`) are recorded as further outputs of each graph.
A model with several KV cache groups (sliding-window layers beside full ones) has a slot and
block-table buffer per group; lengths and positions are shared.

Speculative verify steps (a request's token and its drafts) get graphs of their own with q =
1 + num_speculative_tokens rows a request, so a verify step costs about what a decode step does
(eagerly it cost 3-4 decode steps, all host time). A request with fewer drafts (an n-gram
drafter finds fewer, a request near its max_tokens) is padded to q rows: its padding rows sit at
the positions after its drafts, write no KV (slot -1) and are dropped from the output; causal
attention keeps them out of the real rows' view.

A hybrid model's recurrent layers read their state slots (and whether each row has a state)
from two more static buffers; padded rows use the pool's padding slot, from a zero state. Its
decode steps only (q = 1) are recorded: a verify step keeps per-row states for the rollback
and its padding rows would run through the recurrence, so it runs eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from jackfield.contracts.attention import AttentionMetadata, StepContext
from jackfield.contracts.model import LayerTaps, ModelFamily
from jackfield.engine.block_table import BlockTableRows, slots_at
from jackfield.engine.recurrent_state import RecurrentStates
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.models.attention import StepContextBuilder
from jackfield.ops.staging import CopyFence, CpuGpuBuffer

if TYPE_CHECKING:
    from jackfield.engine.model_runner import InFlightIds


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    """One CUDA graph of the model's forward per captured batch size and rows a request (1 for
    decode steps; 1 + k for verify steps when a drafter proposes k)."""

    def __init__(self, model: ModelFamily, kv_caches: list[torch.Tensor],
                 kv_scales: list[torch.Tensor | None], contexts: StepContextBuilder,
                 block_tables: BlockTableRows, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int,
                 device: torch.device, query_lens: tuple[int, ...] = (1,),
                 recurrent: RecurrentStates | None = None, tap_layers: tuple[int, ...] = (),
                 record: bool = True) -> None:
        """`contexts`: the runner's, so a replay's attention metadata is built as an eager step's;
        `kv_scales`: the fp8 caches' scales (read by address: later values reach every replay);
        `block_tables`: every request's tables, one per KV cache group (the block manager's
        rows); `query_lens`: the rows a request to record;
        `recurrent`: a hybrid model's state pool (then q = 1 only); `tap_layers`: layers whose
        inputs each replay also gives (a drafter's taps). record=False runs the forward over the
        same static buffers and capture-time metadata without graphs (on any device): the data
        flow of a replay, checkable where CUDA graphs are not."""
        if recurrent is not None and set(query_lens) != {1}:
            raise ValueError(f"a hybrid model's verify steps run eagerly: record q = 1 only, "
                             f"not {query_lens}")
        self.model, self.kv_caches, self.kv_scales, self.contexts = model, kv_caches, kv_scales, contexts
        self.tap_layers, self.record = tap_layers, record
        self.block_tables = block_tables
        self.block_size, self.max_model_len = block_size, max_model_len
        self.num_blocks = num_blocks  # of every cache (one block pool)
        self.sizes = capture_sizes(max_num_seqs)
        self.query_lens = tuple(sorted(query_lens))
        largest, width = self.sizes[-1], -(-max_model_len // block_size)
        rows = largest * self.query_lens[-1]
        self.input_ids = CpuGpuBuffer(rows, dtype=torch.int64, device=device)
        self.positions = CpuGpuBuffer(rows, dtype=torch.int64, device=device)
        self.real_rows = CpuGpuBuffer(rows, dtype=torch.int64, device=device)
        self.seq_lens = CpuGpuBuffer(largest, dtype=torch.int32, device=device)
        groups = range(block_tables.array.shape[0])
        self.slot_mapping = [CpuGpuBuffer(rows, dtype=torch.int64, device=device) for _ in groups]
        self.block_table = [CpuGpuBuffer(largest, width, dtype=torch.int32, device=device) for _ in groups]
        self.query_start_loc = {q: torch.arange(largest + 1, dtype=torch.int32, device=device) * q
                                for q in self.query_lens}
        self.recurrent = recurrent
        self.state_slots = CpuGpuBuffer(largest, dtype=torch.int64, device=device)
        self.has_state = CpuGpuBuffer(largest, dtype=torch.bool, device=device)
        self.fence = CopyFence(device)  # the host buffers above are rewritten each step
        # per (batch size, rows a request): the graph, its final hidden states and its tapped
        # layer inputs (output buffers), and the step context it was recorded with: a replay reads
        # the context's tensors by address (a hybrid model's recurrent metadata is made for the
        # capture), so they live as long as the graph; freed, their memory would go to other
        # tensors and a replay would index with whatever those hold
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                 list[torch.Tensor | None], StepContext]] = {}
        self.unrecorded: dict[tuple[int, int], StepContext] = {}  # record=False: the metadata instead
        # the last run's final hidden states and tapped layer inputs, q rows a request padded to
        # its batch size (a recorded graph's output buffers): a drafter's graphs read them
        self.last_outputs: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        pool = torch.cuda.graph_pool_handle() if self.record else None
        for q in reversed(self.query_lens):
            for size in reversed(self.sizes):
                if progress:
                    rows = f", {q} rows a request" if q > 1 else ""
                    progress(f"capturing CUDA graphs: batch {size}{rows}")
                self._fill([], size, q)
                context = self._context(size, q)
                if pool is None:
                    self.unrecorded[size, q] = context
                    continue
                # warm-up (Triton compiles, cuBLAS picks kernels) and capture get distinct positions
                # views: the RoPE tables are gathered once per positions tensor, and that gather must
                # be recorded, not reused from the warm-up
                self._forward(size, q, context)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden, states = self._forward(size, q, context)
                self.graphs[size, q] = (graph, hidden, states, context)
        if pool is not None:
            torch.cuda.synchronize()

    def _forward(self, size: int, q: int, context: StepContext,
                 ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The model over the static buffers of `size` requests of q rows: its final hidden
        states and tapped layer inputs."""
        taps = LayerTaps(self.tap_layers, self.model.capabilities.num_layers)
        rows = size * q
        hidden = self.model(self.input_ids.gpu[:rows], self.positions.gpu[:rows], context, taps=taps)
        return hidden, taps.states

    def query_len(self, chunks: list[ScheduledChunk]) -> int | None:
        """The recorded rows a request that serve this step, or None (the step runs eagerly).
        Recorded: steps of sampling decodes and verifies only (every row samples, so the step ends
        in the token read-back), no larger than the largest captured batch, whose rows (padding
        included) stay within max_model_len. A one-token slice of a chunked prefill does not
        sample: such a step runs eagerly."""
        if len(chunks) > self.sizes[-1] or not all(c.is_decode and c.samples and c.seq.pooling is None
                                                   for c in chunks):
            return None
        longest = max((c.num_tokens for c in chunks), default=1)
        q = next((q for q in self.query_lens if q >= longest), None)
        if q is None or any(c.seq.num_computed + q > self.max_model_len for c in chunks):
            return None
        return q

    def run(self, chunks: list[ScheduledChunk], q: int, taps: LayerTaps | None = None,
            in_flight: InFlightIds | None = None) -> torch.Tensor:
        """The hidden states of the step's rows, request by request ([sum of num_tokens, D]; with
        q = 1 a view of the graph's output buffer, valid until the next replay); `taps` (of the
        recorded `tap_layers`) gets the tapped layers' inputs of the same rows; `in_flight`
        writes the input tokens that are still on the device (async scheduling)."""
        size = next(s for s in self.sizes if s >= len(chunks))
        total = self._fill(chunks, size, q)
        if in_flight is not None:
            in_flight.write(self.input_ids.gpu)
        if self.record:
            graph, hidden, states, _ = self.graphs[size, q]
            graph.replay()
        else:
            hidden, states = self._forward(size, q, self.unrecorded[size, q])
        self.last_outputs = hidden, states

        def real(rows: torch.Tensor) -> torch.Tensor:
            return rows[: len(chunks)] if q == 1 else rows.index_select(0, self.real_rows.gpu[:total])

        if taps is not None:
            for layer, state in zip(self.tap_layers, states, strict=True):
                assert state is not None, "the forward offers every layer's input"
                taps.offer(layer, real(state))
        return real(hidden)

    def _fill(self, chunks: list[ScheduledChunk], size: int, q: int) -> int:
        """Write the step's rows into the static buffers (q rows a request); rows past the batch
        see no KV and write none; returns the real rows. The pinned host buffers are rewritten
        once the previous fill's copies out of them ran (`CopyFence`: under async scheduling
        they may still be queued). The index arithmetic runs in numpy over them: at batch 1
        torch's per-op dispatch was most of the fill."""
        self.fence.wait()
        n, bs, rows, pad = len(chunks), self.block_size, size * q, size - len(chunks)
        ids: list[int] = []
        for c in chunks:
            real = c.input_ids
            ids += real + real[-1:] * (q - len(real))  # padding rows repeat the last token
        starts = np.array([c.seq.num_computed for c in chunks] + [0] * pad, dtype=np.int64)
        offsets = np.arange(q)
        positions = starts[:, None] + offsets  # [size, q]
        is_real = offsets < np.array([c.num_tokens for c in chunks], dtype=np.int64)[:, None]  # [n, q]
        self.input_ids.np[: n * q] = ids
        self.input_ids.np[n * q : rows] = 0
        self.positions.np[:rows] = positions.reshape(-1)
        self.seq_lens.np[:size] = starts + q
        self.seq_lens.np[n:size] = 0
        for buffer, count in ((self.input_ids, rows), (self.positions, rows), (self.seq_lens, size)):
            buffer.copy_to_device(count)
        total = sum(c.num_tokens for c in chunks)
        if q > 1:
            self.real_rows.np[:total] = is_real.reshape(-1).nonzero()[0]
            self.real_rows.copy_to_device(total)
        if self.recurrent is not None:  # q = 1 (the constructor checked it)
            state_slots = [c.seq.state_slot for c in chunks]
            if None in state_slots:
                raise RuntimeError("a decode of a hybrid model without a recurrent state slot")
            self.state_slots.np[:size] = state_slots + [self.recurrent.padding_slot] * pad
            # a one-token prompt decodes from a zero state too
            self.has_state.np[:size] = starts > 0
            self.state_slots.copy_to_device(size)
            self.has_state.copy_to_device(size)
        # Capture fills no rows: every slot -1, so the warm-up and recorded forwards write no KV.
        tables = self.block_tables.gather_array([c.seq.table_row for c in chunks])  # type: ignore[misc]
        width = tables.shape[2]
        if n and not 0 <= tables.min() <= tables.max() < self.num_blocks:
            raise ValueError(f"decode block ids {tables.min()}..{tables.max()} outside the cache's "
                             f"{self.num_blocks} blocks")
        for group_table, slot_mapping, block_table in zip(tables, self.slot_mapping, self.block_table,
                                                          strict=True):
            # a padding row may sit past its request's blocks: its slot is -1 anyway
            slots = slots_at(group_table, positions[:n], bs)
            slot_mapping.np[: n * q] = np.where(is_real, slots, -1).reshape(-1)
            slot_mapping.np[n * q : rows] = -1
            slot_mapping.copy_to_device(rows)
            # entries past a request's blocks are read only by padding rows (output dropped)
            block_table.np[:n, :width] = group_table
            block_table.copy_to_device(n)
        self.fence.record()
        return total

    def static_metadata(self, size: int, q: int, seq_lens: torch.Tensor | None = None,
                        slot_mapping: list[torch.Tensor] | None = None) -> list[AttentionMetadata]:
        """Per KV cache group, metadata of `size` requests of q rows over static buffers, with
        the Python values as upper bounds: the block tables are this object's, `seq_lens` [size]
        and `slot_mapping` (per group, [size * q]) this object's unless given (a drafter's rows
        over the same requests)."""
        seq_lens = self.seq_lens.gpu[:size] if seq_lens is None else seq_lens
        slots = [b.gpu[: size * q] for b in self.slot_mapping] if slot_mapping is None else slot_mapping
        return [
            AttentionMetadata(
                query_start_loc=self.query_start_loc[q][: size + 1],
                seq_lens=seq_lens,
                block_table=block_table.gpu[:size],
                slot_mapping=group_slots,
                query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32) * q,
                seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
                max_query_len=q,
                max_seq_len=self.max_model_len,
                num_decodes=size,
                num_decode_tokens=size * q,
            )
            for group_slots, block_table in zip(slots, self.block_table, strict=True)
        ]

    def _context(self, size: int, q: int) -> StepContext:
        """The model's step context over the static buffers."""
        per_group = self.static_metadata(size, q)
        context = self.contexts.build(self.kv_caches, per_group, for_capture=True, kv_scales=self.kv_scales)
        if self.recurrent is None:
            return context
        step = self.recurrent.decode_step(self.state_slots.gpu[:size], self.has_state.gpu[:size])
        return dataclasses.replace(context, recurrent=step)
