"""Prefill and mixed steps replayed piecewise from CUDA graphs (vLLM's piecewise mode).

A prefill step of a small model on a fast GPU is bound by the host as much as a decode step:
hundreds of launches behind Python (on the H200, a 512-token prefill of the 8-layer bench model
was ~17 ms of host time against ~3 ms of GPU work). Attention cannot be recorded (its metadata
is data-dependent and read on the host), everything else can: a model's forward is made of
pieces (`embed`, `before_attention`, `attend`, `after_attention`, `final_norm`: the contract in
contracts/model.py), so it runs as L + 1 graphs around L eager attention calls:

    graph 0:   embed, before_attention(0)
    graph i:   after_attention(i - 1), before_attention(i)          (1 <= i < L)
    graph L:   after_attention(L - 1), final_norm

Graphs are recorded per token count (16, 32, ..., 512, then every 512 up to the cap); a step's
rows are padded up to the next one. Padded rows carry stale ids and positions and never reach
attention (it sees the step's rows only), so they cost arithmetic, not correctness. Every piece
copies what it leaves behind into static buffers sized once for the largest step (the residual
stream in two alternating buffers, the attention inputs, the final hidden states), so a graph
holds no tensor of its own after capture: the pool holds one piece's temporaries, not
layers x sizes of them. The pieces need no host sync (the engine checks the model's
`cuda_graph_safe` capability).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from jackfield.contracts.attention import StepContext
from jackfield.contracts.model import LayerHooks, LayerTaps, ModelFamily


def piece_sizes(max_tokens: int) -> list[int]:
    """Token counts to record: powers of two from 16 to 512, then multiples of 512 (padding
    wastes at most half a small step and 511 rows of a large one), and max_tokens itself."""
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s < max_tokens]
    sizes += range(1024, max_tokens, 512)
    return [*sizes, max_tokens]


class PiecewiseGraphs:
    """Per recorded token count, the L + 1 graphs of the pieces between attention calls."""

    def __init__(self, model: ModelFamily, max_tokens: int, device: torch.device,
                 record: bool = True) -> None:
        """record=False runs the same pieces over the same static buffers without graphs (on any
        device): the data flow of a replay, checkable where CUDA graphs are not."""
        self.model, self.max_tokens, self.device, self.record = model, max_tokens, device, record
        self.sizes = piece_sizes(max_tokens)
        self.num_layers = model.capabilities.num_layers
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # each attention call's output, which the next piece reads (zeros until the first step)
        self.attn_out = torch.zeros(max_tokens, *model.attention_output_shape, dtype=model.capabilities.dtype,
                                    device=device)
        # made at the first (largest, eager) run, when the pieces' output shapes are known
        self.residual: tuple[torch.Tensor, torch.Tensor] | None = None  # piece i writes [i % 2]
        self.attn_inputs: tuple[torch.Tensor, ...] = ()
        self.hidden: torch.Tensor | None = None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        pool = torch.cuda.graph_pool_handle() if self.record else None
        for size in reversed(self.sizes):  # largest first: it sizes the static buffers
            if progress:
                progress(f"capturing prefill CUDA graphs: {size} tokens")
            # warm-up (cuBLAS and Triton choose kernels) and capture get distinct positions views:
            # the RoPE tables are gathered once per positions tensor, and the capture must record it
            self._run_pieces(size, self.positions[:size], graph_pool=None)
            if pool is not None:
                torch.cuda.synchronize()
                self.graphs[size] = self._run_pieces(size, self.positions[:size], graph_pool=pool)
        if pool is not None:
            torch.cuda.synchronize()

    def _static_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.max_tokens, *t.shape[1:], dtype=t.dtype, device=self.device)

    def _keep(self, i: int, outputs: tuple[torch.Tensor, ...]) -> None:
        """Copy piece i's outputs into the static buffers (made from the first outputs seen)."""
        size = outputs[0].shape[0]
        if i == self.num_layers:
            if self.hidden is None:
                self.hidden = self._static_like(outputs[0])
            self.hidden[:size].copy_(outputs[0])
            return
        if self.residual is None:
            self.residual = (self._static_like(outputs[0]), self._static_like(outputs[0]))
            self.attn_inputs = tuple(self._static_like(t) for t in outputs[1:])
        self.residual[i % 2][:size].copy_(outputs[0])
        for buffer, t in zip(self.attn_inputs, outputs[1:], strict=True):
            buffer[:size].copy_(t)

    def _piece(self, i: int, size: int, positions: torch.Tensor) -> None:
        """Piece i at `size` tokens, from the static buffers into the static buffers."""
        model = self.model
        if i == 0:
            y = model.embed(self.input_ids[:size])
        else:
            assert self.residual is not None
            y = model.after_attention(i - 1, self.residual[(i - 1) % 2][:size], self.attn_out[:size])
        if i == self.num_layers:
            self._keep(i, (model.final_norm(y),))
        else:
            self._keep(i, (y, *model.before_attention(i, y, positions)))

    def _run_pieces(self, size: int, positions: torch.Tensor, graph_pool: tuple[int, int] | None,
                    ) -> list[torch.cuda.CUDAGraph]:
        """Every piece at `size` tokens in order, eagerly (graph_pool None) or each recorded into a
        graph; attention is not run: the pieces read the static attention buffer as it is."""
        recorded = []
        for i in range(self.num_layers + 1):
            if graph_pool is None:
                self._piece(i, size, positions)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=graph_pool):
                self._piece(i, size, positions)
            recorded.append(graph)
        return recorded

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext,
            hooks: LayerHooks | None = None, taps: LayerTaps | None = None) -> torch.Tensor:
        """Final hidden states [T, D] of the step's T rows (a view of a static buffer, valid until
        the next replay). input_ids and positions are the step's device tensors; `hooks` run
        around each (eager) attention call; `taps` gets copies of its layers' inputs (piece i
        leaves layer i's input in a residual buffer that piece i + 2 overwrites)."""
        num_tokens = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        if self.record:
            pieces = [graph.replay for graph in self.graphs[size]]
        else:  # a new positions view: the RoPE rows are gathered again, as graph 0's replay does
            positions_view = self.positions[:size]
            pieces = [partial(self._piece, i, size, positions_view)
                      for i in range(self.num_layers + 1)]
        *before_attention, last = pieces
        for i, piece in enumerate(before_attention):
            piece()
            if taps is not None and i in taps.layers:
                assert self.residual is not None
                taps.offer(i, self.residual[i % 2][:num_tokens].clone())
            inputs = tuple(t[:num_tokens] for t in self.attn_inputs)
            if hooks is not None:
                hooks.before_attend(i)
            self.attn_out[:num_tokens].copy_(self.model.attend(i, step, inputs))
            if hooks is not None:
                hooks.after_attend(i)
        last()
        assert self.hidden is not None
        return self.hidden[:num_tokens]
