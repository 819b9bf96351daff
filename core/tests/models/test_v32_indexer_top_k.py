"""DeepSeek-V3.2's indexer top-k of decode rows, batched and sync-free, against a float64 formula
and against the per-request loop (which prefill rows keep): random caches, block tables, lengths
and rows a request, once as an eager step has them and once as a decode CUDA graph replays them
(padded to q rows a request, padding requests, the graph's static max_seq_len and block-table
width, stale table entries)."""

from __future__ import annotations

import dataclasses

import torch
from jackfield.contracts.attention import AttentionMetadata
from jackfield.models.deepseek_v32 import Indexer
from jackfield.models.hf_config import deepseek_arch
from jackfield.testing.checkpoints import DEEPSEEK_V32
from transformers import DeepseekV32Config

TOPK, BLOCK, BOUND, Q = 8, 4, 64, 3  # BOUND: the graphs' max_seq_len (max_model_len)
TIE = 1e-5  # scores this close to the k-th best are ties (float32 choices, float64 scores)


@dataclasses.dataclass(frozen=True)
class Request:
    start: int  # KV already in the cache
    rows: int  # new rows (1..Q)
    table: list[int]  # physical blocks for start + Q positions


def indexer() -> Indexer:
    config = DeepseekV32Config(**DEEPSEEK_V32, index_topk=TOPK, architectures=["DeepseekV32ForCausalLM"])
    return Indexer(deepseek_arch(config), torch.float32)


def metadata(lens: list[int], q_lens: list[int], tables: list[list[int]], slots: list[int],
             max_seq_len: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=torch.tensor(seq_lens_cpu, dtype=torch.int32), max_query_len=max(q_lens),
        max_seq_len=max_seq_len, num_decodes=len(lens), num_decode_tokens=int(qsl[-1]))


def reference_scores(cache: torch.Tensor, request: Request, row: int, q: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
    """float64 score of every key row `row` of `request` sees (positions 0..its own)."""
    dim = q.shape[-1]
    keys = torch.stack([cache[request.table[s // BLOCK], s % BLOCK] for s in range(request.start + row + 1)])
    per_head = torch.relu(q.double() @ keys.double().T / dim**0.5)  # [H, S]
    return w.double() @ per_head


def check_choice(chosen: torch.Tensor, scores: torch.Tensor, width: int) -> set[int]:
    """`chosen` (one row of top-k output) holds min(width, visible) distinct visible keys, then -1s,
    and is a best choice: every key scoring above the k-th best is in it, none below."""
    picked = [int(i) for i in chosen if i >= 0]
    k = min(width, scores.numel())
    assert chosen.numel() == width and (chosen[len(picked):] == -1).all(), chosen
    assert len(picked) == k == len(set(picked)) and all(i < scores.numel() for i in picked), (picked, k)
    kth = scores.sort(descending=True).values[k - 1] if k else None
    if kth is not None:
        assert all(scores[i] >= kth - TIE for i in picked)
        assert {int(i) for i in torch.nonzero(scores > kth + TIE)} <= set(picked)
    return set(picked)


def same_up_to_ties(a: set[int], b: set[int], scores: torch.Tensor, width: int) -> bool:
    k = min(width, scores.numel())
    kth = scores.sort(descending=True).values[k - 1] if k else 0.0
    return all(abs(float(scores[i]) - float(kth)) <= TIE for i in a ^ b)


def test_batched_top_k_matches_the_loop_and_float64(rng_seed: int) -> None:
    print(f"seed={rng_seed}")
    gen = torch.Generator().manual_seed(rng_seed)
    ix = indexer()
    heads, dim = ix.heads, ix.dim
    num_blocks = 80
    cache = torch.randn(num_blocks, BLOCK, dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    requests = []
    # one request sees fewer than TOPK keys, one reaches BOUND with its padding rows, the rest anywhere
    for start in [2, BOUND - Q] + torch.randint(0, BOUND - Q, (5,), generator=gen).tolist():
        rows = int(torch.randint(1, Q + 1, (), generator=gen))
        blocks = -(-(start + Q) // BLOCK)
        requests.append(Request(start, rows, [free.pop() for _ in range(blocks)]))
    total = sum(r.rows for r in requests)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, dim, generator=gen)
    w = torch.randn(total, heads, generator=gen)

    def slot(r: Request, p: int) -> int:
        return r.table[p // BLOCK] * BLOCK + p % BLOCK

    # An eager decode step: each request's own rows and lengths.
    lens = [r.start + r.rows for r in requests]
    new_slots = [slot(r, p) for r in requests for p in range(r.start, r.start + r.rows)]
    tables = [r.table for r in requests]
    eager = metadata(lens, [r.rows for r in requests], tables, new_slots, max(lens), lens)
    eager_cache = cache.clone()
    batched = ix.top_k(q, k, w, eager_cache, eager)  # decode rows: the batched path
    looped = ix.top_k_per_request(q, w, eager_cache, eager)
    assert batched.dtype == torch.int32 and batched.shape == looped.shape == (total, min(TOPK, max(lens)))

    # The same step as a decode graph replays it: Q rows a request (padding rows after the real
    # ones, slot -1, junk inputs), two padding requests (seq_len 0), the static max_seq_len and
    # block-table width, table entries past a request's blocks left from earlier steps.
    width = BOUND // BLOCK
    tables = [table + torch.randint(0, num_blocks, (width - len(table),), generator=gen).tolist()
              for table in tables]
    tables += [torch.randint(0, num_blocks, (width,), generator=gen).tolist() for _ in range(2)]
    real = [i * Q + j for i, r in enumerate(requests) for j in range(r.rows)]
    size = len(requests) + 2
    slots = [-1] * (size * Q)
    for i, r in enumerate(requests):
        for j in range(r.rows):
            slots[i * Q + j] = slot(r, r.start + j)
    graph = metadata([r.start + Q for r in requests] + [0, 0], [Q] * size, tables, slots, BOUND,
                     [BOUND] * size)
    padded_q = torch.randn(size * Q, heads, dim, generator=gen)
    padded_k = torch.randn(size * Q, dim, generator=gen)
    padded_w = torch.randn(size * Q, heads, generator=gen)
    padded_q[real], padded_k[real], padded_w[real] = q, k, w
    graph_cache = cache.clone()
    replayed = ix.top_k(padded_q, padded_k, padded_w, graph_cache, graph)
    assert replayed.shape == (size * Q, min(TOPK, BOUND))
    assert torch.equal(graph_cache, eager_cache), "padding rows wrote KV, or real rows wrote elsewhere"
    assert (replayed[len(requests) * Q :] == -1).all(), "a padding request saw keys"

    row = 0
    for i, r in enumerate(requests):
        for j in range(r.rows):
            scores = reference_scores(eager_cache, r, j, q[row], w[row])
            want = check_choice(looped[row], scores, min(TOPK, eager.max_seq_len))
            got = check_choice(batched[row], scores, min(TOPK, eager.max_seq_len))
            from_graph = check_choice(replayed[i * Q + j], scores, min(TOPK, BOUND))
            assert same_up_to_ties(got, want, scores, TOPK)
            assert same_up_to_ties(from_graph, want, scores, TOPK)
            row += 1


def test_batched_top_k_bounds_its_scores_in_chunks(rng_seed: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Scores held a few keys at a time (SCORE_ELEMENTS small) pick what one chunk picks."""
    import jackfield.models.deepseek_v32 as v32

    print(f"seed={rng_seed}")
    gen = torch.Generator().manual_seed(rng_seed)
    ix = indexer()
    cache = torch.randn(40, BLOCK, ix.dim, generator=gen)
    tables = [torch.randperm(40, generator=gen)[:16].tolist() for _ in range(3)]
    lens = [50, 17, 61]
    md = metadata(lens, [1, 1, 1], tables, [-1, -1, -1], BOUND, [BOUND] * 3)
    q, w = torch.randn(3, ix.heads, ix.dim, generator=gen), torch.randn(3, ix.heads, generator=gen)
    whole = ix.top_k_batched(q, w, cache, md)
    monkeypatch.setattr(v32, "SCORE_ELEMENTS", 3 * ix.dim * 5)  # 5 keys a chunk
    chunked = ix.top_k_batched(q, w, cache, md)
    assert torch.equal(whole.sort(dim=1).values, chunked.sort(dim=1).values)
