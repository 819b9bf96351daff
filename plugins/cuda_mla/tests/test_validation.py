"""Every entry-point check of the kernels, and the plugin's registration and fail-closed probe."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch
from jackfield.contracts.attention import AttentionRequirements
from jackfield_cuda_mla.capabilities import CUDA_MLA_CAPABILITIES, cuda_mla_availability
from jackfield_cuda_mla.kernels import mla_decode, mla_kv_insert
from jackfield_cuda_mla.kernels.decode import DecodeConfig

R, P, PAGE = 64, 16, 16
FP8 = torch.float8_e4m3fn


def insert_args(**over):
    args = dict(
        kv_c=torch.randn(4, R),
        k_pe=torch.randn(4, P),
        kv_cache=torch.zeros(2, PAGE, R + P),
        slot_mapping=torch.arange(4),
        kv_scale=None,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,message",
    [
        (dict(kv_cache=torch.zeros(2, PAGE * (R + P))), "kv_cache must be"),
        (dict(kv_cache=torch.zeros(2, PAGE, R + P, dtype=torch.int32)), "kv_cache dtype"),
        (dict(kv_cache=torch.zeros(2, R + P, PAGE).transpose(1, 2)), "contiguous"),
        (dict(kv_cache=torch.zeros(2, 2 * PAGE, R + P)[:, :PAGE]), "blocks must be dense"),
        (dict(kv_c=torch.randn(4, R + 1)), "!= cache record width"),
        (dict(kv_c=torch.randn(4)), "2-D"),
        (dict(k_pe=torch.randn(3, P)), "tokens but k_pe"),
        (dict(slot_mapping=torch.arange(3)), "slot_mapping must be"),
        (dict(slot_mapping=torch.arange(4.0)), "int32 or int64"),
        (dict(slot_mapping=torch.arange(8)[::2]), "contiguous"),
        (dict(kv_c=torch.randn(4, R, dtype=torch.float64)), "kv_c dtype"),
        (dict(k_pe=torch.randn(P, 4).T), "k_pe rows must be contiguous"),
        (dict(kv_c=torch.randn(4, R, device="meta")), "kv_c is on meta"),
        (dict(slot_mapping=torch.arange(4, device="meta")), "slot_mapping is on meta"),
        (dict(kv_cache=torch.zeros(2, PAGE, R + P, dtype=FP8)), "needs kv_scale"),
        (
            dict(kv_cache=torch.zeros(2, PAGE, R + P, dtype=FP8), kv_scale=torch.ones(2)),
            "one per-tensor value",
        ),
        (
            dict(
                kv_cache=torch.zeros(2, PAGE, R + P, dtype=FP8), kv_scale=torch.ones(1, dtype=torch.float64)
            ),
            "float32",
        ),
        (
            dict(kv_cache=torch.zeros(2, PAGE, R + P, dtype=FP8), kv_scale=torch.ones(1, device="meta")),
            "kv_scale is on meta",
        ),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 2 * PAGE])), "slot_mapping holds slot 32"),
    ],
)
def test_insert_rejects_bad_input(over: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mla_kv_insert(**insert_args(**over))


def decode_args(**over):
    args = dict(
        query=torch.randn(2, 4, R + P, dtype=torch.float16),
        kv_cache=torch.zeros(4, PAGE, R + P, dtype=torch.float16),
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        seq_lens=torch.tensor([5, 9], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=9,
        sm_scale=0.1,
        kv_lora_rank=R,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,message",
    [
        (dict(query=torch.randn(2, R + P, dtype=torch.float16)), "query must be"),
        (dict(query=torch.randn(2, 4, R, dtype=torch.float16)), "record width"),
        (dict(kv_lora_rank=R + P), "kv_lora_rank"),
        (dict(query=torch.randn(2, 4, R + P).to(torch.int8)), "query dtype"),
        (dict(query=torch.randn(2, 4, R + P)), "must match query"),
        (
            dict(query=torch.randn(2, R + P, 4, dtype=torch.float16).transpose(1, 2)),
            "query must be contiguous",
        ),
        (dict(query=torch.randn(2, 4, R + P, dtype=torch.float16, device="meta")), "query is on meta"),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table dtype"),
        (dict(block_table=torch.zeros(2, dtype=torch.int32)), "block_table must be 2-D"),
        (dict(seq_lens=torch.tensor([5, 9, 1], dtype=torch.int32)), "query_start_loc must be"),
        (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), "block_table has 3 rows"),
        (dict(max_seq_len=33), "exceeds the block table"),
        (dict(kv_cache=torch.zeros(4, PAGE, R + P, dtype=FP8)), "needs kv_scale"),
        (dict(topk_indices=torch.zeros(3, 8, dtype=torch.int32)), "topk_indices has 3 rows"),
        (dict(topk_indices=torch.zeros(2, 8, dtype=torch.int64)), "topk_indices dtype"),
        (dict(out=torch.empty(2, 4, R)), "out must be"),
        (dict(lse=torch.empty(2, 4, dtype=torch.float16)), "lse must be"),
        (dict(config=DecodeConfig(16, 16, 4, 1, swap=True)), "swapped products need num_stages >= 2"),
    ],
)
def test_decode_rejects_bad_input(over: dict, message: str) -> None:
    args = decode_args(**over)
    with pytest.raises(ValueError, match=message):
        mla_decode(
            args.pop("query"),
            args.pop("kv_cache"),
            args.pop("block_table"),
            args.pop("seq_lens"),
            args.pop("query_start_loc"),
            **args,
        )


def test_capabilities_validate_reasons() -> None:
    req = AttentionRequirements(
        kind="mha",
        dtype=torch.float32,
        head_size=576,
        block_size=24,
        device="cpu",
        sinks=True,
        max_decode_query_len=9,
    )
    from jackfield_cuda_mla.backend import CudaMLABackend

    reasons = "\n".join(CudaMLABackend.validate(req))
    for part in ("kind 'mha'", "float32", "multiple of 16", "device 'cpu'", "sinks", "decode query length 9"):
        assert part in reasons
    if not torch.cuda.is_available():
        assert "unavailable: no CUDA device" in reasons
    # 64-key pages: whole TMA tiles for the Hopper kernels (the engine's default block size).
    assert CUDA_MLA_CAPABILITIES.max_decode_query_len == 8
    assert CUDA_MLA_CAPABILITIES.preferred_block_size == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_availability_fails_closed_without_cuda() -> None:
    answer = cuda_mla_availability()
    assert not answer.ok and "no CUDA device" in answer.reason


def _installed() -> bool:
    try:
        importlib.metadata.version("jackfield-cuda-mla")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="jackfield-cuda-mla is not pip-installed (no entry point)")
def test_listing_the_plugin_imports_no_kernels() -> None:
    code = (
        "import sys; from jackfield.plugins import get_registry; r = get_registry();"
        "e = r.lookup('attention', 'cuda_mla'); assert e.distribution == 'jackfield-cuda-mla', e;"
        "assert 'jackfield_cuda_mla.kernels' not in sys.modules, 'kernels imported';"
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
