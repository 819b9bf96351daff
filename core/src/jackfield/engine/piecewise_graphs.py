"""Prefill and mixed steps replayed piecewise from CUDA graphs (vLLM's piecewise mode).

A prefill step of a small model on a fast GPU is bound by the host as much as a decode step:
hundreds of launches behind Python (on the H200, a 512-token prefill of the 8-layer bench model
was ~17 ms of host time against ~3 ms of GPU work). Attention cannot be recorded (its metadata
is data-dependent and read on the host), everything else can: a model that exposes its forward
in pieces (`embed`, `before_attention`, `attend`, `after_attention`, `final_norm`, as
DeepseekForCausalLM does) runs as L + 1 graphs around L eager attention calls:

    graph 0:   embed, before_attention(0)
    graph i:   after_attention(i - 1), before_attention(i)          (1 <= i < L)
    graph L:   after_attention(L - 1), final_norm

Graphs are recorded per token count (powers of two from 16 up to the cap,
engine.prefill_graph_max_tokens); a step's rows are padded up to the next one. Padded rows carry
stale ids and positions and never reach attention (it sees the step's rows only), so they cost
arithmetic, not correctness. The pieces need no host sync (the engine checks `cuda_graph_safe`).

Memory: each graph keeps its outputs (residual stream and attention inputs) alive, so the pool
holds about num_layers x (sum of sizes ~ 2 x cap) rows of them (the bench model at 8192 tokens:
~1.6 GiB), taken after the KV cache: the cap bounds it, and a capture that runs out of memory
names the knobs. Copying every piece's outputs into shared static buffers would bring this down
to one piece's temporaries (branch piecewise-static-buffers: CPU-tested, not yet run on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from jackfield.models.attention import StepContext


def piece_sizes(max_tokens: int) -> list[int]:
    """Token counts to record: 16, 32, 64, ... below max_tokens, and max_tokens itself."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


def is_piecewise(model: nn.Module) -> bool:
    """The model's own class declares (`forward_in_pieces`) that its forward is exactly its pieces
    around the attention calls: num_attention_layers, attention_output_shape, embed,
    before_attention, attend, after_attention, final_norm. Not inherited: a subclass that changes
    the forward must not be replayed from its parent's pieces unless it says so itself."""
    return bool(type(model).__dict__.get("forward_in_pieces", False))


class PiecewiseGraphs:
    """Per recorded token count, the L + 1 graphs of the pieces between attention calls."""

    def __init__(self, model: nn.Module, max_tokens: int, device: torch.device) -> None:
        self.model = model
        self.sizes = piece_sizes(max_tokens)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # each attention call's output, which the next piece reads (zeros until the first step)
        self.attn_out = torch.zeros(max_tokens, *model.attention_output_shape, dtype=model.dtype, device=device)
        # per size: the graphs in order, and what each leaves behind (x, then attention inputs)
        self.graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]]] = {}

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            if progress:
                progress(f"capturing prefill CUDA graphs: {size} tokens")
            # warm-up (cuBLAS and Triton choose kernels) and capture get distinct positions views:
            # the RoPE tables are gathered once per positions tensor, and the capture must record it
            self._run_pieces(size, self.positions[:size], graph_pool=None)
            torch.cuda.synchronize()
            self.graphs[size] = self._run_pieces(size, self.positions[:size], graph_pool=pool)
        torch.cuda.synchronize()

    def _run_pieces(self, size: int, positions: torch.Tensor, graph_pool: tuple[int, int] | None,
                    ) -> list[tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]]:
        """Every piece at `size` tokens in order, eagerly (graph_pool None) or each recorded into a
        graph; attention is not run: the pieces read the static attention buffer as it is."""
        model = self.model
        last = model.num_attention_layers
        recorded: list[tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = []
        x: torch.Tensor | None = None
        for i in range(last + 1):
            def piece(i: int = i, x: torch.Tensor | None = x) -> tuple[torch.Tensor, ...]:
                if i == 0:
                    y = model.embed(self.input_ids[:size])
                else:
                    assert x is not None
                    y = model.after_attention(i - 1, x, self.attn_out[:size])
                if i == last:
                    return (model.final_norm(y),)
                return (y, *model.before_attention(i, y, positions))
            if graph_pool is None:
                outputs = piece()
            else:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=graph_pool):
                    outputs = piece()
                recorded.append((graph, outputs))
            x = outputs[0]
        return recorded

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Final hidden states [T, D] of the step's T rows (a view of the last graph's output,
        valid until the next replay). input_ids and positions are the step's device tensors."""
        num_tokens = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        graphs = self.graphs[size]
        for i, (graph, outputs) in enumerate(graphs[:-1]):
            graph.replay()
            inputs = tuple(t[:num_tokens] for t in outputs[1:])
            self.attn_out[:num_tokens].copy_(self.model.attend(i, step, inputs))
        graph, (hidden,) = graphs[-1]
        graph.replay()
        return hidden[:num_tokens]
