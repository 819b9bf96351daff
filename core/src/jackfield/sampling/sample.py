"""`sample(...)`: the functional entry point of the Gumbel-max sampler, with input validation."""

from __future__ import annotations

import contextlib
import os
from typing import Literal

import torch

from jackfield.sampling.filters import filter_cutoffs
from jackfield.sampling.gumbel_torch import gumbel_argmax_torch
from jackfield.sampling.sanitize import sanitized

Impl = Literal["auto", "torch", "triton"]
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, device: torch.device) -> Literal["torch", "triton"]:
    """ "auto": Triton on CUDA when it is importable, else PyTorch. "triton" off CUDA needs the
    Triton interpreter (TRITON_INTERPRET=1), which is how the CPU tests run the kernel."""
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if impl == "torch":
        return "torch"
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if not triton_importable():
        raise RuntimeError("impl='triton' but triton is not installed (pip install jackfield[triton])")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs CUDA logits, or TRITON_INTERPRET=1 on {device.type}")
    return "triton"


def _check_row_tensor(
    name: str, t: torch.Tensor | None, dtypes: tuple[torch.dtype, ...], rows: int, device: torch.device
) -> list[str]:
    if t is None:
        return []
    if not isinstance(t, torch.Tensor):
        return [f"{name} must be a torch.Tensor, got {type(t).__name__}"]
    errors = []
    if t.dtype not in dtypes:
        errors.append(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.shape != (rows,):
        errors.append(f"{name} must have shape ({rows},) (one per logits row), got {tuple(t.shape)}")
    if t.device != device:
        errors.append(f"{name} is on {t.device} but logits are on {device}")
    return errors


def validate_inputs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> None:
    """Raise ValueError listing every problem with dtypes, shapes and devices (no device sync)."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    errors = []
    if logits.dtype not in LOGIT_DTYPES:
        errors.append(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() != 2:
        errors.append(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    elif logits.shape[1] == 0:
        errors.append("logits must have a vocabulary of at least one token")
    elif logits.shape[1] >= 2**31 - 1:
        errors.append(f"vocab {logits.shape[1]} does not fit int32 token ids")
    rows, device = (logits.shape[0] if logits.dim() >= 1 else 0), logits.device
    floats = (torch.float32,)
    errors += _check_row_tensor("temperature", temperature, floats, rows, device)
    errors += _check_row_tensor("seeds", seeds, (torch.int64,), rows, device)
    errors += _check_row_tensor("positions", positions, (torch.int64,), rows, device)
    errors += _check_row_tensor("top_k", top_k, (torch.int64, torch.int32), rows, device)
    errors += _check_row_tensor("top_p", top_p, floats, rows, device)
    errors += _check_row_tensor("min_p", min_p, floats, rows, device)
    if errors:
        raise ValueError("invalid sample() inputs: " + "; ".join(errors))


def sample_with_scores(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    impl: Impl = "auto",
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` that also returns each row's winning score (-inf: the row had no finite logit).

    block: the Triton sub-block size (LaunchShape.sub_block; results do not depend on it).
    """
    validate_inputs(logits, temperature, seeds, positions, top_k, top_p, min_p)
    chosen = resolve_impl(impl, logits.device)
    if chosen == "torch":
        temperature, top_p, min_p = sanitized(temperature, top_p, min_p)
        cutoff = filter_cutoffs(logits, temperature, top_k, top_p, min_p)
        return gumbel_argmax_torch(logits, temperature, seeds, positions, cutoff)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # The kernels read per-row values at base + row: dense rows, whatever views came in. They
    # sanitize temperature, top_p and min_p as they load them (sanitize.py): no launches here.
    temperature, seeds, positions = temperature.contiguous(), seeds.contiguous(), positions.contiguous()
    top_k, top_p, min_p = (t.contiguous() if t is not None else None for t in (top_k, top_p, min_p))
    with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
        return _sample_triton(logits, temperature, seeds, positions, top_k, top_p, min_p, block)


def _sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    block: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature only: the two-stage Gumbel kernels, no device sync. With filters: top-k rows
    (k <= KMAX) are filtered and sampled from their candidates (filters_triton.py); one sync reads
    which other rows remain, and those get the whole-row kernels with their cutoff."""
    from jackfield.sampling import filters_triton
    from jackfield.sampling.gumbel_triton import DEFAULT_SHAPE, gumbel_argmax_triton

    shape = DEFAULT_SHAPE if block is None else DEFAULT_SHAPE.with_sub_block(block)
    if top_k is None and top_p is None and min_p is None:
        return gumbel_argmax_triton(logits, temperature, seeds, positions, None, shape)
    token, score, cutoff, status, flags = filters_triton.filter_and_sample_triton(
        logits, temperature, seeds, positions, top_k, top_p, min_p
    )
    present = int(flags.item())  # a device sync (a row falling back to the torch cutoff adds one)
    if present & (1 << filters_triton.NEEDS_TORCH_CUTOFF):
        safe_t, safe_p, safe_min_p = sanitized(temperature, top_p, min_p)
        torch_cutoff = filter_cutoffs(logits, safe_t, top_k, safe_p, safe_min_p)
        assert torch_cutoff is not None  # such a row uses top-k or top-p
        cutoff = torch.where(status == filters_triton.NEEDS_TORCH_CUTOFF, torch_cutoff, cutoff)
    if present & ~(1 << filters_triton.DONE):
        done = (status == filters_triton.DONE).to(torch.uint8)
        gumbel_argmax_triton(
            logits, temperature, seeds, positions, cutoff, shape, skip=done, out=(token, score)
        )
    return token, score


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Seeded Gumbel-max sampling: int64 token ids, one per row of logits [R, V].

    Per row: temperature 0 is the exact argmax (lowest index on ties); otherwise
    argmax(logits / temperature + gumbel_noise(seed, position, token)) over the tokens that
    survive top-k / top-p / min-p. NaN and +-inf logits are never sampled; a row with no finite
    logit returns token 0. temperature, top_p, min_p: float32 [R]; seeds, positions: int64 [R];
    top_k: int64 or int32 [R] (<= 0: off). Temperatures below 1e-5 are greedy (see sanitize.py for
    the other out-of-range values). impl: "torch", "triton" or "auto" (Triton on CUDA when available).
    """
    return sample_with_scores(logits, temperature, seeds, positions, top_k, top_p, min_p, impl)[0]
