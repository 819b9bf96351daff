"""Greedy tokens on CUDA: per row the first maximum of the finite logits, in two small kernels.

PyTorch's path (engine/model_runner.greedy on the CPU) is nan_to_num over the float32 logits, a
max over the row, a comparison and a where: four kernels, and at batch 64 over a 128k vocabulary
a float32 copy of the logits written and read again (~66 MB) every decode step. Here:
1. `_chunk_argmax` (program per (row, CHUNK tokens)): the chunk's largest finite logit and its
   first index (NaN and +-inf are never chosen), -inf and no index where none is finite;
2. `_row_argmax` (program per row): the largest chunk maximum and, among the chunks that hold it,
   the first index; -1 where no chunk held a finite logit.
Comparisons only, no arithmetic: the token is the one PyTorch's path picks, ties included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jackfield.ops.launch import DirectLauncher

CHUNK = 4096  # logits a stage-1 program reads: ~32 chunks of a 128k row, 2k programs at batch 64
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_argmax(logits_ptr, row_stride, chunk_max_ptr, chunk_index_ptr, vocab, num_chunks,
                  CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + index, mask=index < vocab, other=float("-inf"))
    finite = (x == x) & (tl.abs(x) < float("inf"))
    x = tl.where(finite, x, float("-inf"))
    best = tl.max(x, 0)
    first = tl.min(tl.where(finite & (x == best), index, _NO_INDEX), 0)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, best)
    tl.store(chunk_index_ptr + row * num_chunks + chunk, first)


@triton.jit
def _row_argmax(chunk_max_ptr, chunk_index_ptr, tokens_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    used = c < num_chunks
    best_of_chunk = tl.load(chunk_max_ptr + row * num_chunks + c, mask=used, other=float("-inf"))
    first_of_chunk = tl.load(chunk_index_ptr + row * num_chunks + c, mask=used, other=_NO_INDEX)
    best = tl.max(best_of_chunk, 0)
    first = tl.min(tl.where(best_of_chunk == best, first_of_chunk, _NO_INDEX), 0)
    tl.store(tokens_ptr + row, tl.where(first == _NO_INDEX, -1, first).to(tl.int64))


_launch_chunk_argmax = DirectLauncher(_chunk_argmax)
_launch_row_argmax = DirectLauncher(_row_argmax)


def greedy_tokens_triton(logits: torch.Tensor) -> torch.Tensor:
    """int64 [R]: each row's first maximum among the finite entries of float32 logits [R, V] (the
    last dimension contiguous), -1 for a row without a finite logit."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and vocab < 2**31 - 1
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    num_chunks = triton.cdiv(vocab, CHUNK)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _launch_chunk_argmax((rows, num_chunks), logits, logits.stride(0), chunk_max, chunk_index, vocab,
                         num_chunks, CHUNK=CHUNK, num_warps=8)
    _launch_row_argmax((rows,), chunk_max, chunk_index, tokens, num_chunks,
                       CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1)
    return tokens
