"""Which stage-1 kernel `mla_decode` picks, and what it hands the Gluon launchers (no GPU needed).

The choice asks for a Hopper GPU (`decode._on_hopper`); here that check says yes, so that the
shape rules (`*_shapes_fit`) and the choice itself run on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from jackfield_cuda_mla.kernels import decode
from jackfield_cuda_mla.kernels.decode import DecodeConfig, default_config, gluon_supported

FP8 = torch.float8_e4m3fn
RANK, ROPE, PAGE = 512, 64, 64
needs_gluon = pytest.mark.skipif(decode.decode_gluon_few is None, reason="this Triton has no usable Gluon")
needs_gluon_fp8 = pytest.mark.skipif(
    decode.decode_gluon_fp8 is None, reason="this Triton has no usable Gluon for the register-operand kernel"
)


def test_gluon_runs_only_on_the_triton_releases_it_is_built_for() -> None:
    assert [gluon_supported(v) for v in ("3.6.0", "3.7.1", "3.9.0", "3.6.0rc1+git2f3a")] == [True] * 4
    assert not any(gluon_supported(v) for v in ("3.5.1", "3.2.0", "3.10.0", "4.0.0", "nightly"))


@pytest.fixture
def shapes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device check says Hopper: only the shape rules decide."""
    monkeypatch.setattr(decode, "_on_hopper", lambda device: True)


@needs_gluon
def test_cpu_tensors_take_the_triton_kernel_even_when_the_shapes_fit() -> None:
    query = torch.randn(2, 16, RANK + ROPE).bfloat16()
    cache = torch.randn(8, PAGE, RANK + ROPE).bfloat16()
    assert decode.decode_gluon_few.few_rows_shapes_fit(query, cache, 16, RANK)
    assert not decode._on_hopper(cache.device)
    assert decode._stage1_kernel(default_config(16, True), False, query, cache, 16, RANK) == "triton"
    query = torch.randn(2, 128, RANK + ROPE).bfloat16()
    assert decode.decode_gluon_many.many_rows_shapes_fit(query, cache, RANK, 64, 2)
    assert decode._stage1_kernel(default_config(128, True), False, query, cache, 128, RANK) == "triton"


def choice(heads: int, q_len: int, query_dtype: torch.dtype, cache_dtype: torch.dtype, sparse: bool = False):
    query = torch.randn(q_len, heads, RANK + ROPE).to(query_dtype)
    cache = torch.randn(4, PAGE, RANK + ROPE).to(cache_dtype)
    rows = heads if sparse else q_len * heads
    cfg = default_config(rows, on_gpu=True, cache_dtype=cache_dtype, sparse=sparse)
    return decode._stage1_kernel(cfg, sparse, query, cache, rows, RANK)


@needs_gluon
def test_default_configs_pick_the_kernel_that_serves_the_call(shapes_only: None) -> None:
    bf16 = torch.bfloat16
    assert choice(16, 1, bf16, bf16) == "gluon_few"
    assert choice(16, 2, bf16, bf16) == "gluon_few"  # MTP: 32 rows
    assert choice(16, 1, bf16, FP8) == ("triton" if decode.decode_gluon_fp8 is None else "gluon_fp8")
    assert choice(128, 1, bf16, bf16) == "gluon_many"
    assert choice(64, 2, torch.float16, torch.float16) == "gluon_many"
    assert choice(16, 1, torch.float16, torch.float16) == "triton"  # few rows need a bf16 query
    assert choice(16, 1, torch.float16, FP8) == "triton"
    assert choice(16, 4, bf16, bf16) == "triton"  # 64 rows of 16 heads: a row block mixes tokens
    assert choice(96, 1, bf16, bf16) == "triton"
    assert choice(128, 1, bf16, FP8) == "triton"  # fp8 with many rows: the tl kernel
    assert choice(128, 1, torch.float32, torch.float32) == "triton"
    assert choice(16, 1, bf16, bf16, sparse=True) == "triton"
    assert choice(128, 1, bf16, bf16, sparse=True) == "triton"


@needs_gluon
def test_fp8_without_its_gluon_kernel_takes_the_triton_kernel(
    shapes_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Triton that builds the bf16 Gluon kernels but not the fp8 one: fp8 caches go to the tl
    kernel (no other kernel reads fp8 tiles), bf16 caches still to Gluon."""
    monkeypatch.setattr(decode, "decode_gluon_fp8", None)
    assert choice(16, 1, torch.bfloat16, FP8) == "triton"
    assert choice(16, 2, torch.bfloat16, FP8) == "triton"
    assert choice(16, 1, torch.bfloat16, torch.bfloat16) == "gluon_few"


class Recorder:
    """Stands in for a launcher: records its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs) -> None:
        self.calls.append((args, kwargs))


@needs_gluon
@needs_gluon_fp8
@pytest.mark.parametrize("fp8, q_len", [(False, 1), (False, 2), (True, 1), (True, 2)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # stage 2 then merges partials nobody wrote
def test_few_rows_launch_gets_the_call_and_a_split_plan_of_its_own_tile(
    shapes_only: None, monkeypatch: pytest.MonkeyPatch, fp8: bool, q_len: int
) -> None:
    """bf16 caches go to launch_few_rows; fp8 caches (16 or 32 rows) to the register-operand kernel
    (decode_gluon_fp8), with the same arguments."""
    launch, register_launch = Recorder(), Recorder()
    monkeypatch.setattr(decode.decode_gluon_few, "launch_few_rows", launch)
    monkeypatch.setattr(decode.decode_gluon_fp8, "launch_register_operands", register_launch)
    monkeypatch.setattr(decode, "_num_sms", lambda device: 132)
    reqs, seq = 4, 4096
    query = torch.randn(reqs * q_len, 16, RANK + ROPE).bfloat16()
    cache = torch.randn(reqs * seq // PAGE, PAGE, RANK + ROPE)
    scale = torch.tensor([0.5]) if fp8 else None
    cache = cache.to(FP8) if fp8 else cache.bfloat16()
    table = torch.arange(reqs * seq // PAGE, dtype=torch.int32).reshape(reqs, -1)
    seq_lens = torch.full((reqs,), seq, dtype=torch.int32)
    qsl = torch.arange(0, reqs * q_len + 1, q_len, dtype=torch.int32)
    out, lse = decode.mla_decode(
        query, cache, table, seq_lens, qsl, max_query_len=q_len, max_seq_len=seq, sm_scale=0.1,
        kv_lora_rank=RANK, kv_scale=scale, config=default_config(16 * q_len, True, cache.dtype),
    )  # fmt: skip
    used, unused = (register_launch, launch) if fp8 else (launch, register_launch)
    assert unused.calls == []
    ((args, kwargs),) = used.calls
    assert args[0] is query and args[1] is cache and args[2] is table and args[3] is seq_lens
    assert args[4] is qsl and kwargs == {}
    rest = list(args[5:])
    kv_scale = rest.pop(4) if fp8 else None  # the register kernel's fifth argument after qsl
    part_out, part_lse, stride_os, stride_ls, scale_log2, rows, splits, causal, rank = rest
    assert rows == 16 * q_len
    # 4 requests on 132 SMs, one program each: 33 splits wanted, 64-key tiles of 4096 keys allow 16
    tokens = reqs * q_len
    assert splits == 16 and part_out.shape == (tokens, 16, splits, RANK)
    assert part_lse.shape == (tokens, 16, splits)
    assert (stride_os, stride_ls) == (part_out.stride(2), part_lse.stride(2))
    assert causal and rank == RANK and scale_log2 == pytest.approx(0.1 * decode.LOG2E)
    assert kv_scale is scale


@needs_gluon
def test_many_rows_launch_takes_the_configs_tile(shapes_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = Recorder()
    monkeypatch.setattr(decode.decode_gluon_many, "launch_many_rows", launch)
    query = torch.randn(3, 128, RANK + ROPE).bfloat16()
    cache = torch.randn(12, PAGE, RANK + ROPE).bfloat16()
    table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    config = DecodeConfig(64, 32, 8, 4, tma=True, gluon=True)
    decode.mla_decode(
        query, cache, table, torch.tensor([256, 5, 100], dtype=torch.int32),
        torch.arange(4, dtype=torch.int32), max_query_len=1, max_seq_len=256, sm_scale=0.1,
        kv_lora_rank=RANK, causal=False, num_splits=1, config=config,
    )  # fmt: skip
    ((args, kwargs),) = launch.calls
    assert args[0] is query and args[5].shape == (3, 128, RANK)  # one split: the output itself
    assert kwargs["block_n"] == 32 and kwargs["stages"] == 4 and kwargs["splits"] == 1
    assert kwargs["max_query_len"] == 1 and kwargs["causal"] is False
