"""Decode and KV insert inside CUDA graphs (how engines run decode), and the direct launch path.

Each case captures the call once over static buffers, then writes new values into those buffers
(query, cache, lengths, top-k indices) and replays: the replay must equal an eager call on the new
values bit for bit (same kernels, same splits), and differ from the first values' output (nothing
stale replayed). Eager calls after the first go through jackfield.ops.launch's DirectLauncher; they
must also equal Triton's own dispatch bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import triton
from jackfield_cuda_mla.kernels import decode, kv_insert, mla_decode, mla_kv_insert

pytestmark = pytest.mark.gpu
RANK, ROPE, PAGE = 512, 64, 64
FP8 = torch.float8_e4m3fn
# name -> (heads, q_len, query dtype, fp8 cache, top-k): which stage-1 kernel each reaches on Hopper
CASES = {
    "few rows bf16": (16, 1, torch.bfloat16, False, 0),
    "few rows fp8": (16, 1, torch.bfloat16, True, 0),
    "few rows fp8 MTP": (16, 2, torch.bfloat16, True, 0),
    "many rows bf16": (128, 1, torch.bfloat16, False, 0),
    "triton kernel fp16": (16, 1, torch.float16, False, 0),
    "sparse top-k": (64, 2, torch.bfloat16, False, 96),
}
SEQ_LENS = [300, 1, 129, 64]


def fill(buffers: dict, case: tuple, seed: int) -> None:
    """New values into the static buffers, in place (a graph replays on the same addresses)."""
    heads, q_len, dtype, fp8, topk = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    values = torch.randn(buffers["cache"].shape, device="cuda", generator=g)
    buffers["cache"].copy_((values / 0.05).clamp(-448, 448).to(FP8) if fp8 else values.to(dtype))
    buffers["query"].copy_(torch.randn(buffers["query"].shape, device="cuda", generator=g).to(dtype))
    lens = torch.tensor(SEQ_LENS, device="cuda").roll(seed)  # same maximum, other requests
    buffers["seq_lens"].copy_(lens.int())
    if topk:
        picks = torch.rand(len(SEQ_LENS) * q_len, max(SEQ_LENS), device="cuda", generator=g).argsort(1)
        indices = picks[:, :topk].int()
        own_len = lens.repeat_interleave(q_len)[:, None]
        buffers["topk"].copy_(torch.where(indices < own_len, indices, -1))


def make_buffers(case: tuple) -> dict:
    heads, q_len, dtype, fp8, topk = case
    reqs, pages = len(SEQ_LENS), max(SEQ_LENS) // PAGE + 1
    tokens = reqs * q_len
    table = torch.randperm(2 * reqs * pages, device="cuda", dtype=torch.int32)[: reqs * pages]
    return dict(
        cache=torch.empty(2 * reqs * pages, PAGE, RANK + ROPE, device="cuda", dtype=FP8 if fp8 else dtype),
        query=torch.empty(tokens, heads, RANK + ROPE, device="cuda", dtype=dtype),
        table=table.view(reqs, pages),
        seq_lens=torch.empty(reqs, device="cuda", dtype=torch.int32),
        starts=torch.arange(0, tokens + 1, q_len, device="cuda", dtype=torch.int32),
        topk=torch.empty(tokens, topk, device="cuda", dtype=torch.int32) if topk else None,
        scale=torch.tensor([0.05], device="cuda") if fp8 else None,
    )


def run_decode(buffers: dict, case: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_decode(
        buffers["query"],
        buffers["cache"],
        buffers["table"],
        buffers["seq_lens"],
        buffers["starts"],
        max_query_len=case[1],
        max_seq_len=max(SEQ_LENS),
        sm_scale=(RANK + ROPE) ** -0.5,
        kv_lora_rank=RANK,
        kv_scale=buffers["scale"],
        topk_indices=buffers["topk"],
    )


def direct_launches() -> int:
    """Launches every cuda_mla launcher sent straight to a kept compiled kernel so far."""
    launchers = [decode._launch_stage1, decode._launch_stage2, kv_insert._launch_kv_insert]
    if decode.decode_gluon_few is not None:
        few, many = decode.decode_gluon_few, decode.decode_gluon_many
        launchers += [few._launch, many._launch_many_rows]
    if decode.decode_gluon_fp8 is not None:
        launchers.append(decode.decode_gluon_fp8._launch)
    return sum(launcher.direct_launches for launcher in launchers)


def captured(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) outside the capture, as engines do
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = direct_launches()
    with torch.cuda.graph(graph):
        result = fn()
    assert direct_launches() > before  # the graph holds the direct launches' kernels
    return graph, result


@pytest.mark.parametrize("name", list(CASES))
def test_decode_replays_in_a_cuda_graph_on_new_values(name: str) -> None:
    case = CASES[name]
    buffers = make_buffers(case)
    fill(buffers, case, seed=1)
    graph, (out, lse) = captured(lambda: run_decode(buffers, case))
    first = [t.clone() for t in run_decode(buffers, case)]
    fill(buffers, case, seed=2)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    want = run_decode(buffers, case)
    torch.cuda.synchronize()
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert not torch.equal(out, first[0])


def no_hook(metadata: object) -> None:
    """Installed as a launch hook (as a profiler's), it sends every launch through Triton's dispatch."""


@pytest.mark.parametrize("name", list(CASES))
def test_direct_launches_equal_triton_dispatch(name: str) -> None:
    case = CASES[name]
    buffers = make_buffers(case)
    fill(buffers, case, seed=3)
    run_decode(buffers, case)  # the first launch of each specialization goes through Triton
    before = direct_launches()
    direct = [t.clone() for t in run_decode(buffers, case)]
    assert direct_launches() > before
    before = direct_launches()
    triton.knobs.runtime.launch_enter_hook.add(no_hook)
    try:
        dispatched = run_decode(buffers, case)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(no_hook)
    assert direct_launches() == before
    torch.cuda.synchronize()
    assert torch.equal(direct[0], dispatched[0]) and torch.equal(direct[1], dispatched[1])
    assert not direct[0].isnan().any()


@pytest.mark.parametrize("fp8", [False, True])
def test_kv_insert_replays_in_a_cuda_graph(fp8: bool) -> None:
    tokens, blocks = 300, 16
    cache = torch.full((blocks, PAGE, RANK + ROPE), float("nan"), device="cuda").to(
        FP8 if fp8 else torch.bfloat16
    )
    kv_c = torch.empty(tokens, RANK, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.empty(tokens, ROPE, device="cuda", dtype=torch.bfloat16)
    slots = torch.empty(tokens, device="cuda", dtype=torch.int64)
    scale = torch.tensor([0.05], device="cuda") if fp8 else None

    def refill(seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        kv_c.copy_(torch.randn(tokens, RANK, device="cuda", generator=g))
        k_pe.copy_(torch.randn(tokens, ROPE, device="cuda", generator=g))
        slots.copy_(torch.randperm(blocks * PAGE, device="cuda", generator=g)[:tokens])
        slots[::7] = -1  # skipped

    refill(1)
    graph, _ = captured(lambda: mla_kv_insert(kv_c, k_pe, cache, slots, kv_scale=scale))
    refill(2)
    graph.replay()
    torch.cuda.synchronize()
    replayed = cache.clone()
    eager = torch.full_like(cache.float(), float("nan")).to(cache.dtype)
    mla_kv_insert(kv_c, k_pe, eager, slots, kv_scale=scale)
    written = slots[slots >= 0]
    flat_r, flat_e = replayed.view(-1, RANK + ROPE), eager.view(-1, RANK + ROPE)
    assert torch.equal(flat_r[written].view(torch.uint8), flat_e[written].view(torch.uint8))
