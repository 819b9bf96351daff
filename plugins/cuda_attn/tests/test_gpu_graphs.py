"""A decode step (KV insert + attention) inside a CUDA graph, as engines run decode.

Each case records impl.forward once over static buffers whose metadata carries only upper bounds
on the host (max_seq_len = the table's capacity), then writes new values into those buffers
(query, new KV, lengths, block tables, slots; one request padded to seq_len 0 and slot -1) and
replays: the replay must equal an eager call on the new values bit for bit (same kernels, same
splits), match the float64 formula, and differ from the first values' output.
"""

from __future__ import annotations

import pytest
import torch
from jackfield.contracts.attention import AttentionMetadata
from jackfield.ops.reference import paged_attention as reference_attention
from jackfield.testing import checks
from jackfield.testing.problems import mha_layer
from jackfield_cuda_attn.backend import CudaAttnBackend
from jackfield_cuda_attn.kernels import attention, kv_insert

pytestmark = pytest.mark.gpu
PAGE, PAGES_PER_REQ, NUM_BLOCKS = 64, 40, 512
FP8 = torch.float8_e4m3fn
# name -> (query heads, KV heads, head size, query rows per request, dtype, fp8 cache, window, sinks)
CASES = {
    "gqa bf16": (32, 8, 128, 1, torch.bfloat16, False, None, False),
    "gqa fp8": (32, 8, 128, 1, torch.bfloat16, True, None, False),
    "mha fp16 d64": (16, 16, 64, 1, torch.float16, False, None, False),
    "mqa d256 window sinks": (8, 1, 256, 1, torch.bfloat16, False, 300, True),
    "multi-token decode": (32, 8, 128, 4, torch.bfloat16, False, None, True),
}
REQS = 6
FP8_SCALES = (0.05, 0.03)  # key scale, value scale


def make_buffers(case: tuple) -> dict:
    heads, kv_heads, head_size, q_len, dtype, fp8, _, sinks = case
    tokens = REQS * q_len
    cache_dtype = FP8 if fp8 else dtype
    return dict(
        cache=torch.zeros(2, NUM_BLOCKS, PAGE, kv_heads, head_size, device="cuda", dtype=cache_dtype),
        query=torch.empty(tokens, heads, head_size, device="cuda", dtype=dtype),
        key=torch.empty(tokens, kv_heads, head_size, device="cuda", dtype=dtype),
        value=torch.empty(tokens, kv_heads, head_size, device="cuda", dtype=dtype),
        table=torch.empty(REQS, PAGES_PER_REQ, device="cuda", dtype=torch.int32),
        seq_lens=torch.empty(REQS, device="cuda", dtype=torch.int32),
        starts=torch.arange(0, tokens + 1, q_len, device="cuda", dtype=torch.int32),
        slots=torch.empty(tokens, device="cuda", dtype=torch.int64),
        scale=torch.tensor(FP8_SCALES, device="cuda") if fp8 else None,  # key, value
        sinks=torch.empty(heads, device="cuda") if sinks else None,
    )


def fill(buffers: dict, case: tuple, seed: int) -> None:
    """New values into the static buffers, in place (a graph replays on the same addresses)."""
    q_len = case[3]
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = buffers["cache"]
    values = torch.randn(cache.shape, device="cuda", generator=g)
    if cache.dtype == FP8:  # keys and values, each by its own scale
        scales = torch.tensor(FP8_SCALES, device="cuda").view(2, 1, 1, 1, 1)
        cache.copy_((values / scales).clamp(-448, 448).to(FP8))
    else:
        cache.copy_(values.to(cache.dtype))
    for name in ("query", "key", "value"):
        buffers[name].copy_(torch.randn(buffers[name].shape, device="cuda", generator=g))
    lens = torch.randint(q_len, PAGE * PAGES_PER_REQ + 1, (REQS,), device="cuda", generator=g)
    lens[seed % REQS] = 0  # a padded request
    buffers["seq_lens"].copy_(lens)
    table = torch.randperm(NUM_BLOCKS, device="cuda", generator=g)[: REQS * PAGES_PER_REQ]
    buffers["table"].copy_(table.view(REQS, PAGES_PER_REQ))
    pos = (lens[:, None] - q_len + torch.arange(q_len, device="cuda")).clamp(min=0)
    slots = buffers["table"].gather(1, pos // PAGE).long() * PAGE + pos % PAGE
    slots[lens == 0] = -1
    buffers["slots"].copy_(slots.flatten())
    if buffers["sinks"] is not None:
        buffers["sinks"].copy_(torch.randn(case[0], device="cuda", generator=g))


def metadata(buffers: dict, case: tuple) -> AttentionMetadata:
    """The metadata a recorded decode step holds: device tensors, host values as upper bounds."""
    bound = PAGE * PAGES_PER_REQ
    q_len = case[3]
    return AttentionMetadata(
        query_start_loc=buffers["starts"],
        seq_lens=buffers["seq_lens"],
        block_table=buffers["table"],
        slot_mapping=buffers["slots"],
        query_start_loc_cpu=buffers["starts"].cpu(),
        seq_lens_cpu=torch.full((REQS,), bound, dtype=torch.int32),
        max_query_len=q_len,
        max_seq_len=bound,
        num_decodes=REQS,
        num_decode_tokens=REQS * q_len,
    )


def direct_launches() -> int:
    launchers = [attention._launch_decode, attention._launch_merge, kv_insert._launch_kv_insert]
    return sum(launcher.direct_launches for launcher in launchers)


@pytest.mark.parametrize("name", list(CASES))
def test_decode_step_replays_in_a_cuda_graph_on_new_values(name: str) -> None:
    case = CASES[name]
    heads, kv_heads, head_size, q_len, dtype, fp8, window, _ = case
    layer = mha_layer(heads, kv_heads, head_size, "fp8_e4m3" if fp8 else "auto", window)
    impl = CudaAttnBackend.make_impl(layer)
    buffers = make_buffers(case)
    md = metadata(buffers, case)

    def step() -> torch.Tensor:
        return impl.forward(buffers["query"], buffers["key"], buffers["value"], buffers["cache"], md,
                            kv_scale=buffers["scale"], sinks=buffers["sinks"])  # fmt: skip

    fill(buffers, case, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) outside the capture, as engines do
        step()
    torch.cuda.current_stream().wait_stream(side)
    fill(buffers, case, seed=1)
    first = step().clone()
    graph = torch.cuda.CUDAGraph()
    before = direct_launches()
    with torch.cuda.graph(graph):
        out = step()
    assert direct_launches() > before  # the graph holds the direct launches' kernels

    fill(buffers, case, seed=2)
    cache_before = buffers["cache"].clone()
    out.fill_(float("nan"))
    graph.replay()
    replayed, cache_replayed = out.clone(), buffers["cache"].clone()
    buffers["cache"].copy_(cache_before)
    checks.poison_allocator("cuda")
    eager = step()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager), "the replay differs from an eager call on the same values"
    assert torch.equal(cache_replayed.view(torch.uint8), buffers["cache"].view(torch.uint8))
    assert not torch.equal(replayed, first), "the replay repeated the recorded values"

    want, _ = reference_attention(
        buffers["query"].double(), buffers["cache"][0], buffers["cache"][1], buffers["table"],
        buffers["seq_lens"], buffers["starts"], layer.scale, sliding_window=window,
        sinks=None if buffers["sinks"] is None else buffers["sinks"].double(), kv_scale=buffers["scale"],
    )  # fmt: skip
    checks.assert_output_close(replayed, want.to(dtype), 2e-2, f"graph replay, {name}")
    padded = (buffers["seq_lens"] == 0).repeat_interleave(q_len)
    assert torch.equal(replayed[padded], torch.zeros_like(replayed[padded])), "a padded row is not 0"
