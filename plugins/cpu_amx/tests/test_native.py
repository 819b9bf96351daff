"""The native decode kernel (native/mla_decode.c) against a float64 reference.

On any CPU through its portable build (the same source, the tile operations and the AVX-512
intrinsics in plain C), whose outputs equal the AVX-512 build's bit for bit (checked where the CPU
has AVX-512-BF16); on an AMX host through the AMX build too.

Tolerance, from the kernel's arithmetic: scores are float32 sums of exact bf16 x bf16 products
(relative error ~1e-6, so the LSE is held to 1e-4); the probabilities P are rounded to bf16 before
P x V (relative 2^-9 each, so at most 2^-9 * max|v| on an output), and the output is rounded to
bf16 (2^-9 relative): |out - ref| <= 2^-8 * max|v| + 2^-8 * |ref| covers both with a factor 2.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from jackfield.testing.problems import mla_layer
from jackfield_cpu_amx.backend import CpuAmxMLAImpl, compute_dtype
from jackfield_cpu_amx.capabilities import AmxStatus, availability, is_amx_bmm_enabled, read_cpu_flags
from jackfield_cpu_amx.native import (
    AVX512_FLAGS,
    NativeKernel,
    decode_kernel_name,
    native_decode_kernel,
    select_native_kernel,
)
from jackfield_cpu_amx.plan import (
    NATIVE_ITEMS_PER_THREAD,
    PLANS_KEY,
    CpuAmxMetadataBuilder,
    RequestGroup,
    plan_key,
)
from jackfield_cpu_amx.testing import Problem, make_problem, reference_attend

MISSING_AVX512 = [flag for flag in AVX512_FLAGS if flag not in read_cpu_flags()]
needs_avx512_bf16 = pytest.mark.skipif(
    bool(MISSING_AVX512), reason=f"needs AVX-512-BF16 hardware: this CPU lacks {', '.join(MISSING_AVX512)}"
)
needs_amx = pytest.mark.skipif(
    not is_amx_bmm_enabled(), reason="needs AMX hardware: AMX-BF16 granted by the OS (the GPU machine's Xeon)"
)


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> NativeKernel:
    return NativeKernel.build("portable", cache=tmp_path_factory.mktemp("native_cache"))


@pytest.fixture(scope="module")
def emulated_tiles(tmp_path_factory: pytest.TempPathFactory) -> NativeKernel:
    return NativeKernel.build("emulated_tiles", cache=tmp_path_factory.mktemp("native_cache"))


@pytest.fixture(scope="module")
def amx(tmp_path_factory: pytest.TempPathFactory) -> NativeKernel:
    return NativeKernel.build("amx", cache=tmp_path_factory.mktemp("native_cache"))


def poison_unowned_slots(problem: Problem) -> None:
    """NaN in every cache slot no request owns (past seq_len in a last block, unused blocks)."""
    block_size = problem.kv_cache.shape[1]
    owned = torch.zeros(problem.kv_cache.shape[:2], dtype=torch.bool)
    for b, seq_len in enumerate(problem.metadata.seq_lens_cpu.tolist()):
        pos = torch.arange(seq_len)
        owned[problem.metadata.block_table[b, pos // block_size].long(), pos % block_size] = True
    problem.kv_cache[~owned] = float("nan")


def only_group(problem: Problem) -> RequestGroup:
    built = CpuAmxMetadataBuilder(group_keys=1 << 30).build(problem.metadata)
    (group,) = built.extra[PLANS_KEY][plan_key(built)].groups
    return group


def reference(problem: Problem, group: RequestGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of each query token over its first visible_keys keys (0: out 0, lse -inf)."""
    tables, lay = group.decode_tables, problem.layer
    assert tables is not None
    block_size = problem.kv_cache.shape[1]
    out = torch.zeros(problem.query.shape[0], lay.num_heads, lay.kv_lora_rank, dtype=torch.float64)
    lse = torch.full(problem.query.shape[:2], -math.inf, dtype=torch.float64)
    for t, visible in enumerate(tables.visible_keys.tolist()):
        if visible <= 0:
            continue
        r = t // tables.q_len
        pos = torch.arange(visible)
        records = problem.kv_cache[tables.block_table[r, pos // block_size].long(), pos % block_size].double()
        scores = problem.query[t].double() @ records.T * lay.scale  # [H, visible]
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ records[:, : lay.kv_lora_rank]
    return out, lse


def run_kernel(
    kernel: NativeKernel, problem: Problem, group: RequestGroup, num_threads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs poisoned with NaN first: every row must be written. The splits are laid out for
    `num_threads`; the kernel runs on up to 2 OpenMP threads (it takes torch's thread count),
    so that its items are shared between threads even where the test process has one."""
    lay = problem.layer
    tables = group.decode_tables
    assert tables is not None
    layout = group.native_layout(problem.kv_cache.shape[1], lay.num_heads, num_threads)
    out = torch.full(
        (problem.query.shape[0], lay.num_heads, lay.kv_lora_rank), math.nan, dtype=torch.bfloat16
    )
    lse = torch.full(problem.query.shape[:2], math.nan)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(min(num_threads, 2))
    try:
        kernel.decode(problem.query, problem.kv_cache, tables, layout, lay.scale, out, lse)
    finally:
        torch.set_num_threads(threads_before)
    return out, lse


def assert_close_to_reference(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, values: torch.Tensor
) -> None:
    assert not out.isnan().any() and not lse.isnan().any()
    blind = ref_lse == -math.inf
    assert torch.equal(lse[blind], ref_lse[blind].float()) and not out[blind].any()
    max_value = float(values.abs().max())
    torch.testing.assert_close(out.double(), ref_out, atol=2**-8 * max_value, rtol=2**-8)
    torch.testing.assert_close(lse[~blind].double(), ref_lse[~blind], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_lora_rank,rope", [(64, 32), (48, 16)])  # 48: a last half column group
@pytest.mark.parametrize("num_heads", [16, 20])  # 20: the last 16-row group padded
@pytest.mark.parametrize("q_len,causal", [(1, True), (2, True), (4, True), (3, False)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_threads", [1, 64])  # 64: several splits per request, merged
def test_portable_kernel_matches_float64(
    portable: NativeKernel,
    kv_lora_rank: int,
    rope: int,
    num_heads: int,
    q_len: int,
    causal: bool,
    block_size: int,
    num_threads: int,
) -> None:
    """Ragged requests: one key (so with q_len > 1 and causal, rows that see no key), a length
    not a multiple of the block or the 64-key chunk, exactly two blocks, several chunks;
    scattered blocks, NaN in every slot nobody owns."""
    layer = mla_layer(num_heads, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope)
    seq_lens = [1, 37, 2 * block_size, 150]
    problem = make_problem(
        layer, [q_len] * 4, seq_lens, block_size, torch.bfloat16, causal=causal, seed=q_len
    )
    poison_unowned_slots(problem)
    group = only_group(problem)
    out, lse = run_kernel(portable, problem, group, num_threads)
    assert_close_to_reference(out, lse, *reference(problem, group), problem.kv_cache.nan_to_num())


@needs_avx512_bf16
@pytest.mark.parametrize(
    "kv_lora_rank,rope,num_heads,q_len,block_size",
    [(64, 32, 16, 1, 16), (48, 16, 20, 3, 32), (512, 64, 16, 2, 64), (512, 64, 128, 1, 64)],
)
@pytest.mark.parametrize("num_threads", [1, 64])
def test_portable_build_equals_the_avx512_build_bit_for_bit(
    portable: NativeKernel,
    emulated_tiles: NativeKernel,
    kv_lora_rank: int,
    rope: int,
    num_heads: int,
    q_len: int,
    block_size: int,
    num_threads: int,
) -> None:
    """portable_simd.h against the instructions it stands in for: the same outputs, bit for bit
    (the two builds differ only there), on ragged requests with NaN in unowned slots."""
    layer = mla_layer(num_heads, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope)
    problem = make_problem(
        layer, [q_len] * 3, [1, 150, 700], block_size, torch.bfloat16, seed=kv_lora_rank + q_len
    )
    poison_unowned_slots(problem)
    group = only_group(problem)
    out, lse = run_kernel(portable, problem, group, num_threads)
    avx512_out, avx512_lse = run_kernel(emulated_tiles, problem, group, num_threads)
    assert torch.equal(out.view(torch.int16), avx512_out.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), avx512_lse.view(torch.int32))


@pytest.mark.parametrize("causal", [True, False])
def test_backend_decodes_through_the_kernel_and_prefills_without(
    portable: NativeKernel, causal: bool
) -> None:
    """The impl given the (portable) kernel: decode groups go to it with the step's tables, the
    prefill group to the flash kernel; the whole batch matches the float64 reference."""
    problem = make_problem(
        mla_layer(16, qk_rope_head_dim=32),
        [1, 3, 12],
        [70, 33, 40],
        16,
        torch.bfloat16,
        num_decodes=2,
        causal=causal,
        seed=4,
    )
    poison_unowned_slots(problem)
    impl = CpuAmxMLAImpl(problem.layer, path="amx_bf16", native_kernel=portable)
    built = CpuAmxMetadataBuilder(group_keys=1 << 30).build(problem.metadata)
    with mock.patch.object(portable, "decode", wraps=portable.decode) as decode:
        result = impl.attend(problem.query, problem.kv_cache, built, return_lse=True)
    assert [call.args[2].q_len for call in decode.call_args_list] == [1, 3]
    ref_out, ref_lse = reference_attend(problem)
    assert not result.out.isnan().any()
    torch.testing.assert_close(result.out.double(), ref_out, atol=2**-8 * 5, rtol=2**-8)
    torch.testing.assert_close(result.lse.double(), ref_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"dtype": torch.float32}, "bfloat16"),
        ({"block_size": 8}, "block size 8"),
        ({"q_len": 9}, "q_len 9"),
        ({"kv_lora_rank": 56, "rope": 40}, "kv_lora_rank 56"),
        ({"rope": 24}, "not a multiple of 32"),
        ({"path": "avx512_fp32"}, "avx512_fp32"),
    ],
)
def test_groups_the_kernel_cannot_take_stay_on_pytorch(
    portable: NativeKernel, change: dict, reason: str
) -> None:
    """Each shape outside the kernel's: the reason names it, the kernel is not called, and the
    result still matches the reference (PyTorch path)."""
    q_len, block_size = change.get("q_len", 2), change.get("block_size", 16)
    layer = mla_layer(
        16, kv_lora_rank=change.get("kv_lora_rank", 64), qk_rope_head_dim=change.get("rope", 32)
    )
    dtype = change.get("dtype", torch.bfloat16)
    problem = make_problem(layer, [q_len, q_len], [30, 17], block_size, dtype, seed=6)
    impl = CpuAmxMLAImpl(layer, path=change.get("path", "amx_bf16"), native_kernel=portable)
    built = CpuAmxMetadataBuilder().build(problem.metadata)
    (group,) = built.extra[PLANS_KEY][plan_key(built)].groups
    q = problem.query.to(compute_dtype(impl.path, dtype))
    assert reason in (impl.native_unfit_reason(group, q, problem.kv_cache) or "")
    with mock.patch.object(portable, "decode", wraps=portable.decode) as decode:
        result = impl.attend(problem.query, problem.kv_cache, built, return_lse=True)
    assert not decode.called
    ref_out, _ = reference_attend(problem)
    torch.testing.assert_close(result.out.double(), ref_out, atol=3e-2, rtol=3e-2)


def test_kernel_checks_its_arguments(portable: NativeKernel) -> None:
    """Pointers go to C unchecked there: every mismatch is a ValueError here, before the call."""
    problem = make_problem(
        mla_layer(16, kv_lora_rank=64, qk_rope_head_dim=32), [1, 1], [30, 17], 16, torch.bfloat16, seed=2
    )
    group = only_group(problem)
    tables, lay = group.decode_tables, problem.layer
    assert tables is not None
    layout = group.native_layout(16, 16, 4)
    out = torch.empty(2, 16, 64, dtype=torch.bfloat16)
    lse = torch.empty(2, 16)
    q, cache = problem.query, problem.kv_cache
    bad_calls = {
        "query must be": (q.float(), cache, layout, out, lse),
        "kv_cache must be": (q, cache.transpose(0, 1).contiguous().transpose(0, 1), layout, out, lse),
        "out must be": (q, cache, layout, torch.empty(2, 64, 16, dtype=torch.bfloat16).transpose(1, 2), lse),
        "lse must be": (q, cache, layout, out, lse.double()),
        "do not fit": (q[:1], cache, layout, out, lse),
        "must start with": (q, cache, layout, torch.empty(2, 8, 64, dtype=torch.bfloat16), lse),
        "kv_lora_rank 72": (q, cache, layout, torch.empty(2, 16, 72, dtype=torch.bfloat16), lse),
        "the layout is for blocks": (q, cache[: layout.block_span[1]], layout, out, lse),
        "of 32 keys, the cache has": (q, cache, dataclasses.replace(layout, block_size=32), out, lse),
        "built for other tables": (
            q,
            cache,
            dataclasses.replace(layout, tables=dataclasses.replace(tables)),
            out,
            lse,
        ),
    }
    for message, (query, kv_cache, lay_out, o, s) in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            portable.decode(query, kv_cache, tables, lay_out, lay.scale, o, s)
    # Tables the C side would read past or misread: checked before the call too.
    bad_tables = {
        "block_table must be": dataclasses.replace(tables, block_table=tables.block_table.long()),
        "visible counts": dataclasses.replace(tables, visible_keys=tables.visible_keys[:1]),
    }
    for message, other in bad_tables.items():
        with pytest.raises(ValueError, match=message):
            portable.decode(q, cache, other, dataclasses.replace(layout, tables=other), lay.scale, out, lse)
    # A layout whose splits do not cover the longest request is refused where it is made.
    with pytest.raises(ValueError, match="splits of"):
        dataclasses.replace(layout, num_splits=1, split_keys=64, num_keys=300)
    with pytest.raises(ValueError, match="whole chunks"):
        dataclasses.replace(layout, split_keys=8)


def test_layout_splits_keys_for_every_thread_and_checks_the_table() -> None:
    """Splits of equal whole 64-key chunks, as short as allowed while there are at most as many
    as NATIVE_ITEMS_PER_THREAD per thread asks for (items: request x 16-row group x split),
    together covering the longest request; a table too narrow for a seq_len is an error."""
    problem = make_problem(mla_layer(20), [1, 1, 1], [300, 5, 129], 16, torch.bfloat16, seed=1)
    group = only_group(problem)
    for threads, expect_splits in ((1, 1), (3, 2), (6, 3), (16, 5), (100, 5)):  # 300 keys: 5 chunks
        layout = group.native_layout(16, 20, threads)
        wanted = -(-NATIVE_ITEMS_PER_THREAD * threads // (3 * 2))  # 3 requests x 2 row groups of 20 heads
        assert layout.num_splits == expect_splits <= wanted
        assert layout.split_keys % 64 == 0 and layout.num_splits * layout.split_keys >= 300
        assert (layout.num_splits - 1) * layout.split_keys < 300  # no split past the longest
        if layout.split_keys > 64:  # a chunk shorter would need more splits than wanted
            assert -(-300 // (layout.split_keys - 64)) > min(wanted, 5)
    with pytest.raises(ValueError, match="blocks of 4"):
        group.native_layout(4, 20, 1)


@pytest.mark.parametrize(
    "enabled,flags,expect",
    [
        (False, AVX512_FLAGS, "no AMX tiles (faked refusal)"),
        (True, ("avx512f",), "the CPU lacks avx512bw, avx512vl, avx512_bf16"),
    ],
)
def test_kernel_selection_says_why_not(enabled: bool, flags: tuple[str, ...], expect: str) -> None:
    kernel = select_native_kernel(AmxStatus(enabled, "faked refusal"), frozenset(flags))
    assert kernel == expect
    assert decode_kernel_name(kernel) == f"PyTorch flash kernel: {expect}"


def test_missing_compiler_keeps_the_pytorch_kernel_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("JACKFIELD_CACHE", str(tmp_path))
    kernel = select_native_kernel(AmxStatus(True, "faked grant"), frozenset(AVX512_FLAGS))
    assert (
        isinstance(kernel, str) and kernel.startswith("native build failed") and "/nonexistent/cc" in kernel
    )
    assert decode_kernel_name(kernel).startswith("PyTorch flash kernel: native build failed")
    impl = CpuAmxMLAImpl(mla_layer(16), path="amx_bf16", native_kernel=kernel)
    assert impl.native_unfit_reason(None, None, None) == kernel  # type: ignore[arg-type]


@pytest.mark.parametrize("failure", ["cache is a file", "library will not load"])
def test_an_unusable_cache_or_library_keeps_the_pytorch_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failure: str
) -> None:
    """Not only a failed compile: a cache that cannot be written (read-only home, a file in the
    way) or a library that will not load (noexec mount, truncated file) leave the PyTorch path."""
    if failure == "cache is a file":
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("JACKFIELD_CACHE", str(tmp_path / "file" / "below"))
    else:
        bad = tmp_path / "bad.so"
        bad.write_bytes(b"not a library")
        monkeypatch.setattr(NativeKernel, "build", classmethod(lambda cls, **kw: cls(bad)))
    kernel = select_native_kernel(AmxStatus(True, "faked grant"), frozenset(AVX512_FLAGS))
    assert isinstance(kernel, str) and kernel.startswith("native kernel unavailable: ")
    assert ("NotADirectoryError" if failure == "cache is a file" else "OSError") in kernel


def test_one_openmp_runtime_in_the_process(portable: NativeKernel) -> None:
    """The library's libgomp.so.1 resolved to the copy torch loaded (two runtimes would each
    keep a thread pool)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(paths) == 1, paths


@needs_amx
@pytest.mark.parametrize("num_heads,q_len", [(16, 1), (16, 2), (128, 1)])
@pytest.mark.parametrize("num_threads", [1, 64])
def test_amx_kernel_matches_float64_at_benchmark_width(
    amx: NativeKernel, num_heads: int, q_len: int, num_threads: int
) -> None:
    """kv_lora_rank 512 + rope 64, block 64, ragged lengths, NaN in unowned slots, on the tiles."""
    layer = mla_layer(num_heads, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    problem = make_problem(layer, [q_len] * 3, [700, 1, 129], 64, torch.bfloat16, seed=num_heads + q_len)
    poison_unowned_slots(problem)
    group = only_group(problem)
    out, lse = run_kernel(amx, problem, group, num_threads)
    assert_close_to_reference(out, lse, *reference(problem, group), problem.kv_cache.nan_to_num())


@needs_amx
def test_amx_host_decodes_with_the_native_kernel() -> None:
    """On the AMX host the build succeeds from the package and the backend says so."""
    assert isinstance(native_decode_kernel(), NativeKernel), native_decode_kernel()
    assert "decode: native AMX kernel" in availability().reason
