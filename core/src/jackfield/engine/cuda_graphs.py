"""Decode steps replayed from CUDA graphs, as vLLM and SGLang do.

A decode step of a small model is bound by the host: hundreds of kernel launches, each behind
Python and the PyTorch dispatcher. Recording the model's forward once per batch size and
replaying it costs one launch. Capture runs at start-up, largest batch first so the smaller
graphs share its memory pool.

What a replay needs: every input lives in a static device buffer (ids, positions, slots, lengths,
block tables), written in place before each replay; batches are padded up to the next captured
size with rows that see no KV (seq_len 0) and write none (slot -1). The attention metadata's
Python values are upper bounds fixed at capture (max_seq_len = max_model_len), which is why only
backends that declare `cuda_graph` support (their decode path reads lengths from the device
tensors, never syncs, and accepts rows with no KV) are captured; the engine runs the rest eagerly.
The slots a replay writes are checked on the host (the kernels' own per-call check would sync).
A drafter's taps (layer inputs, `LayerTaps`) are recorded as further outputs of each graph.
A model with several KV cache groups (sliding-window layers beside full ones) has a slot and
block-table buffer per group; lengths and positions are shared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from jackfield.contracts.attention import AttentionMetadata, StepContext
from jackfield.contracts.model import LayerTaps, ModelFamily
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.models.attention import StepContextBuilder
from jackfield.ops.staging import CpuGpuBuffer, async_tensor_h2d


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    """One CUDA graph of the model's forward per captured batch size (decode rows only)."""

    def __init__(self, model: ModelFamily, kv_caches: list[torch.Tensor],
                 kv_scales: list[torch.Tensor | None], contexts: StepContextBuilder, num_groups: int,
                 num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 device: torch.device, tap_layers: tuple[int, ...] = ()) -> None:
        """`contexts`: the runner's, so a replay's attention metadata is built as an eager step's;
        `kv_scales`: the fp8 caches' scales (read by address: later values reach every replay);
        `num_groups`: the model's KV cache groups; `tap_layers`: layers whose inputs each replay
        also gives (a drafter's taps)."""
        self.model, self.kv_caches, self.kv_scales, self.contexts = model, kv_caches, kv_scales, contexts
        self.tap_layers = tap_layers
        self.block_size, self.max_model_len = block_size, max_model_len
        self.capacity = num_blocks * block_size  # slots of every cache (one block pool)
        self.sizes = capture_sizes(max_num_seqs)
        largest, width = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = CpuGpuBuffer(largest, dtype=torch.int64, device=device)
        self.positions = CpuGpuBuffer(largest, dtype=torch.int64, device=device)
        self.seq_lens = CpuGpuBuffer(largest, dtype=torch.int32, device=device)
        groups = range(num_groups)
        self.slot_mapping = [CpuGpuBuffer(largest, dtype=torch.int64, device=device) for _ in groups]
        self.block_table = [torch.zeros(largest, width, dtype=torch.int32, device=device) for _ in groups]
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        # per size: the graph, its final hidden states and its tapped layer inputs (output buffers)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list[torch.Tensor | None]]] = {}

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            if progress:
                progress(f"capturing CUDA graphs: batch {size}")
            self._fill([], size)
            context = self._context(size)
            ids = self.input_ids.gpu[:size]
            # warm-up (Triton compiles, cuBLAS picks kernels) and capture get distinct positions
            # views: the RoPE tables are gathered once per positions tensor, and that gather must
            # be recorded, not reused from the warm-up
            self.model(ids, self.positions.gpu[:size], context)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            taps = LayerTaps(self.tap_layers, self.model.capabilities.num_layers)
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, self.positions.gpu[:size], context, taps=taps)
            self.graphs[size] = (graph, hidden, taps.states)
        torch.cuda.synchronize()

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """A step of sampling decodes only (one row each, every row samples, so the step ends in
        the token read-back), no larger than the largest captured batch. A one-token slice of a
        chunked prefill does not sample: such a step runs eagerly."""
        return len(chunks) <= self.sizes[-1] and all(
            c.num_tokens == 1 and c.samples and c.seq.pooling is None for c in chunks
        )

    def run(self, chunks: list[ScheduledChunk], taps: LayerTaps | None = None) -> torch.Tensor:
        """The step's final hidden states [len(chunks), D] (a view of the graph's output buffer,
        valid until the next replay); `taps` (of the recorded `tap_layers`) gets the tapped
        layers' inputs, views of the graph's buffers too."""
        size = next(s for s in self.sizes if s >= len(chunks))
        self._fill(chunks, size)
        graph, hidden, states = self.graphs[size]
        graph.replay()
        if taps is not None:
            for layer, state in zip(self.tap_layers, states, strict=True):
                assert state is not None, "the forward offers every layer's input"
                taps.offer(layer, state[: len(chunks)])
        return hidden[: len(chunks)]

    def _fill(self, chunks: list[ScheduledChunk], size: int) -> None:
        """Write the step's rows into the static buffers; rows past the batch see no KV and write none.
        The pinned host buffers are rewritten safely: the previous step's copies finished at its
        token read-back (the one sync a step)."""
        n, bs, pad = len(chunks), self.block_size, size - len(chunks)
        positions = [c.seq.num_computed for c in chunks]
        ids = [c.seq.token_ids[c.seq.num_computed] for c in chunks]
        self.input_ids.cpu[:size] = torch.tensor(ids + [0] * pad)
        self.positions.cpu[:size] = torch.tensor(positions + [0] * pad)
        self.seq_lens.cpu[:size] = torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32)
        for buffer in (self.input_ids, self.positions, self.seq_lens):
            buffer.copy_to_device(size)
        for group, slot_mapping in enumerate(self.slot_mapping):
            block_table = self.block_table[group]
            tables = [c.seq.block_tables[group] for c in chunks]
            slots = [table[p // bs] * bs + p % bs for table, p in zip(tables, positions, strict=True)]
            if slots and not 0 <= min(slots) <= max(slots) < self.capacity:
                raise ValueError(f"decode slots {min(slots)}..{max(slots)} outside the cache's "
                                 f"{self.capacity} slots")
            slot_mapping.cpu[:size] = torch.tensor(slots + [-1] * pad)
            slot_mapping.copy_to_device(size)
            if n:  # entries past a row's seq_len (padding rows: all) are never read, so stale ones stay
                width = max(len(table) for table in tables)
                padded = [table + [0] * (width - len(table)) for table in tables]
                block_table[:n, :width].copy_(async_tensor_h2d(padded, torch.int32, block_table.device, True))

    def _context(self, size: int) -> StepContext:
        """Metadata over the static buffers, with the Python values as upper bounds."""
        per_group = [
            AttentionMetadata(
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens.gpu[:size],
                block_table=block_table[:size],
                slot_mapping=slot_mapping.gpu[:size],
                query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
                seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
                max_query_len=1,
                max_seq_len=self.max_model_len,
                num_decodes=size,
                num_decode_tokens=size,
            )
            for slot_mapping, block_table in zip(self.slot_mapping, self.block_table, strict=True)
        ]
        return self.contexts.build(self.kv_caches, per_group, for_capture=True, kv_scales=self.kv_scales)
