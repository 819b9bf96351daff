"""Assertions and probes the conformance kit uses; messages say what differed and where."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import pytest
import torch

from jackfield.attention.kv_cache import dequantize_cache
from jackfield.contracts.attention import AttentionBackend, AttentionMetadata
from jackfield.plugins import get_registry
from jackfield.specs import resolve_factory


def resolve_backend(name: str | None, cls: type[AttentionBackend] | None) -> type[AttentionBackend]:
    """`cls` if given, else the registry's backend `name` (its record must match the class)."""
    if cls is not None:
        return cls
    if name is None:
        pytest.fail("set `backend_name` (a registered backend) or `backend_cls` on the conformance class")
    entry = get_registry().lookup("attention", name)
    backend = resolve_factory(entry.spec.factory)
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        pytest.fail(f"factory {entry.spec.factory!r} of {name!r} is not an AttentionBackend subclass")
    if backend.capabilities != entry.spec.capabilities:
        pytest.fail(f"{name!r}: the registered capabilities differ from {backend.__name__}.capabilities")
    if backend.name != name:
        pytest.fail(f"registered as {name!r} but {backend.__name__}.name is {backend.name!r}")
    return backend


def poison_allocator(device: str) -> None:
    """Fill freed CUDA allocator memory with NaN bytes so outputs a kernel never writes read as NaN."""
    if torch.device(device).type != "cuda":
        return
    chunks = [torch.empty(size, dtype=torch.uint8, device=device) for size in [64 << 20] + [512 << 10] * 16]
    for chunk in chunks:
        chunk.fill_(0xFF)  # 0xFF.. is NaN in fp32, fp16 and bf16
    del chunks


def same_bytes(a: torch.Tensor, b: torch.Tensor, message: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, message
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), message


def assert_output_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """Same shape/dtype, every element written (finite), error within tol of the output's scale."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    bad = ~torch.isfinite(got)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.numel()} elements not finite (unwritten or NaN)"
    scale = float(want.float().abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(
        got.float(), want.float(), atol=tol * max(scale, 1e-6), rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def assert_lse_close(got: torch.Tensor | None, want: torch.Tensor | None, tol: float, what: str) -> None:
    """float32 [T, H]; -inf exactly where the reference saw no key, finite and close elsewhere."""
    assert want is not None
    assert got is not None, f"{what}: return_lse=True gave no LSE (the backend claims dcp)"
    assert got.dtype == torch.float32 and got.shape == want.shape, (
        f"{what}: got {got.dtype} {tuple(got.shape)}, expected float32 {tuple(want.shape)}"
    )
    empty = want == float("-inf")
    assert torch.equal(got == float("-inf"), empty), f"{what}: -inf rows differ from rows that saw no key"
    assert torch.isfinite(got[~empty]).all(), f"{what}: NaN or +inf where keys were seen"
    torch.testing.assert_close(got[~empty], want[~empty], atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def assert_rejects(call: Callable[[], object], what: str) -> None:
    """`call()` must fail at the entry with ValueError/TypeError (not deep inside a kernel)."""
    try:
        call()
    except (ValueError, TypeError) as exc:
        assert str(exc), f"{what}: raised {type(exc).__name__} with an empty message"
        return
    except Exception as exc:  # noqa: BLE001 - any other error means no entry check caught it
        pytest.fail(f"{what}: raised {type(exc).__name__} ({exc}) instead of a ValueError at the entry")
    pytest.fail(f"{what}: accepted")


def assert_cache_close(
    got: torch.Tensor, want: torch.Tensor, kv_scale: torch.Tensor | None, what: str
) -> None:
    """Caches written by two impls: untouched (NaN-poisoned) slots agree; float caches bit-exact,
    fp8 caches within one e4m3 step (rounding of x / scale may differ by one ulp)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: cache shape/dtype changed"
    if got.dtype != torch.float8_e4m3fn:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
            f"{what}: {int((got != want).sum())} cache elements differ from torch_ref's write"
        )
        return
    assert kv_scale is not None
    g, w = dequantize_cache(got, kv_scale), dequantize_cache(want, kv_scale)
    assert torch.equal(g.isnan(), w.isnan()), (
        f"{what}: written slots differ from torch_ref's (NaN = untouched)"
    )
    keep = ~w.isnan()
    torch.testing.assert_close(
        g[keep], w[keep], rtol=0.13, atol=float(kv_scale.max()) * 2**-9, msg=lambda m: f"{what}: {m}"
    )


def metadata_tensors(metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
    """Every tensor `metadata` reaches, by path: its fields and what a builder put in `extra`,
    through dataclasses, mappings, lists and tuples."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value: object, path: str) -> None:
        if isinstance(value, torch.Tensor):
            found[path] = value
            return
        if id(value) in seen:
            return
        seen.add(id(value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{path}.{f.name}")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]")
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    walk(metadata, "metadata")
    return found


def assert_tensors_unchanged(
    tensors: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor], what: str
) -> None:
    """Each tensor holds the bytes it held in `before` (taken by clone), path by path."""
    changed = [
        path for path, t in tensors.items()
        if path not in before or t.shape != before[path].shape or t.dtype != before[path].dtype
        or not torch.equal(_as_bytes(t), _as_bytes(before[path]))
    ]
    assert not changed, f"{what}: changed {changed}"


def shared_storage(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """Pairs of paths, one from each side, whose (non-empty) tensors share storage."""
    storages = {t.untyped_storage().data_ptr(): path for path, t in b.items() if t.numel()}
    return [(path, storages[ptr]) for path, t in a.items()
            if t.numel() and (ptr := t.untyped_storage().data_ptr()) in storages]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def greedy_runs_agree(want: Sequence[object], got: Sequence[object], tolerance: float = 0.05) -> int:
    """Two greedy runs of the same requests (RequestOutputs with top-k `logprobs`) that should
    differ only by rounding: while the tokens agree, at least 4 of each step's top tokens are
    shared and their logprobs agree within `tolerance`; where the tokens part it is at a near-tie
    of `want`'s step (the texts after that are different and not compared). Returns the number of
    steps compared."""
    compared = 0
    for w, g in zip(want, got, strict=True):
        for step, (w_tok, g_tok, w_lp, g_lp) in enumerate(
            zip(w.token_ids, g.token_ids, w.logprobs, g.logprobs, strict=True)  # type: ignore[attr-defined]
        ):
            if w_tok != g_tok:
                assert g_tok in w_lp and w_lp[w_tok] - w_lp[g_tok] < tolerance, (step, w_lp, g_lp)
                break
            common = set(w_lp) & set(g_lp)
            assert len(common) >= 4, (step, w_lp, g_lp)
            assert max(abs(w_lp[t] - g_lp[t]) for t in common) < tolerance, (step, w_lp, g_lp)
            compared += 1
    return compared
