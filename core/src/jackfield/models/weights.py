"""Declarative checkpoint-name mapping and safetensors loading.

A family declares a `WeightMapper`: rules from Hugging Face tensor names (regexes with named
groups) to the model's parameter names, optionally into one shard of a fused parameter (dim 0
split into parts: equal ones for gate ‖ up, sized by heads for q ‖ k ‖ v) or one expert of a
stacked parameter. Loading checks that every
parameter is written exactly once and that every checkpoint tensor has a home; both failures
name the tensors. fp8 KV-cache scales beside the attention weights are not parameters: the
engine reads them (models/kv_scales.py), the loader passes over them.

Under tensor parallelism a rank loads its shard only (`ShardPlan`): the checkpoint is read
through safetensors slices (`iter_checkpoint_slices`), so a rank never reads a whole tensor it
splits, nor an expert another rank holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from jackfield.distributed.tensor_parallel import part
from jackfield.model_files import ModelFileError
from jackfield.models.kv_scales import is_kv_scale_tensor


@dataclass(frozen=True)
class Rule:
    """`hf` (full-match regex) -> `param` (str.format over the regex groups).

    shard=(i, n): the tensor is part i of n of `param` along dim 0 (gate ‖ up fusions); the parts
    are equal unless `sizes` gives their relative sizes (q ‖ k ‖ v: query heads, KV heads, KV heads).
    expert: the group naming the expert index, for parameters stacked over experts on dim 0.
    """

    hf: str
    param: str
    shard: tuple[int, int] | None = None
    expert: str | None = None
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.sizes is not None and (self.shard is None or len(self.sizes) != self.shard[1]):
            raise ValueError(f"rule {self.hf}: sizes {self.sizes} need a shard (i, {len(self.sizes)})")

    def shard_rows(self, num_rows: int) -> slice:
        """The rows of a `num_rows`-row parameter that this rule's shard fills."""
        assert self.shard is not None
        index, parts = self.shard
        sizes = self.sizes or (1,) * parts
        total = sum(sizes)
        return slice(num_rows * sum(sizes[:index]) // total, num_rows * sum(sizes[: index + 1]) // total)


@dataclass(frozen=True)
class WeightMapper:
    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = ()  # regexes of checkpoint tensors that are deliberately unused

    def target(self, hf_name: str) -> tuple[str, int | None, Rule] | None:
        """(param name, expert index, the rule) for a checkpoint name; None when ignored."""
        for pattern in self.ignore:
            if re.fullmatch(pattern, hf_name):
                return None
        for rule in self.rules:
            match = re.fullmatch(rule.hf, hf_name)
            if match:
                groups = match.groupdict()
                expert = int(groups[rule.expert]) if rule.expert else None
                return rule.param.format(**groups), expert, rule
        raise KeyError(hf_name)


@dataclass(frozen=True)
class Split:
    """A parameter's checkpoint tensors are cut along `dim` into `parts` parts (`part`); this
    rank's parameter holds part `index`. fused=n: the tensor is n equal blocks along `dim`
    (gate ‖ up stored as one tensor), each cut so, and the rank's parts are concatenated."""

    dim: int
    index: int
    parts: int
    fused: int = 1


@dataclass(frozen=True)
class ShardPlan:
    """What one tensor-parallel rank loads: the parameters (full-match regexes, first match wins)
    it holds a `Split` of, and the experts [first, first + count) of expert-stacked parameters
    loaded one expert at a time. Other parameters are loaded whole (replicated). A fused
    parameter whose shards are cut differently (q by query heads, k and v by KV heads) has one
    Split per shard."""

    splits: tuple[tuple[str, Split | tuple[Split, ...]], ...]
    experts: tuple[int, int] | None = None

    def split(self, param: str, shard: tuple[int, int] | None = None) -> Split | None:
        """The Split of `param`, or of its shard `shard` = (i, n)."""
        split = next((split for pattern, split in self.splits if re.fullmatch(pattern, param)), None)
        if isinstance(split, tuple):
            if shard is None or len(split) != shard[1]:
                raise ValueError(f"{param}: {len(split)} splits for shard {shard}")
            return split[shard[0]]
        return split


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in Path(model_dir).glob("*.bin"))
        # Loading a pickle runs code from the file: Jackfield reads safetensors only.
        hint = (f"; {', '.join(pickles[:3])} are PyTorch pickles, which Jackfield does not load (they can "
                "run code): convert them to safetensors") if pickles else ""
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files{hint}")
    return files


def iter_checkpoint(model_dir: str | Path,
                    keep: Callable[[str], object] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the folder's safetensors (only names `keep` accepts: the others
    are never read); a truncated or foreign file is a ModelFileError naming it."""
    for file in checkpoint_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: not a readable safetensors file: {exc}") from exc


def iter_checkpoint_slices(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """Every (name, safetensors slice) of the folder: nothing is read until the slice is indexed
    (`load_weights` reads a tensor's shard only)."""
    for file in checkpoint_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_slice(name)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: not a readable safetensors file: {exc}") from exc


def _read(source: object, split: Split | None) -> torch.Tensor:
    """The tensor, or its `split` part, from a tensor or a safetensors slice (which reads only
    the part)."""
    if isinstance(source, torch.Tensor) and split is None:
        return source
    shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()  # type: ignore[attr-defined]
    if split is None:
        return source[tuple(slice(None) for _ in shape)]  # type: ignore[index]
    block = shape[split.dim] // split.fused
    start, stop = part(block, split.index, split.parts)
    pieces = [source[tuple(slice(b * block + start, b * block + stop) if d == split.dim else slice(None)  # type: ignore[index]
                           for d in range(len(shape)))] for b in range(split.fused)]
    return pieces[0] if split.fused == 1 else torch.cat(pieces, dim=split.dim)


def tensor_names(model_dir: str | Path) -> set[str]:
    """The names of the folder's checkpoint tensors (read from the files' headers only)."""
    names: set[str] = set()
    for file in checkpoint_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                names.update(f.keys())
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: not a readable safetensors file: {exc}") from exc
    return names


def load_weights(
    params: dict[str, torch.Tensor],
    weights: Iterator[tuple[str, object]],
    mapper: WeightMapper,
    shards: ShardPlan | None = None,
) -> None:
    """Copy checkpoint tensors (or safetensors slices) into `params` (converting dtype), only
    this rank's part of them under `shards`; fail naming what is off."""
    written: dict[str, int] = {name: 0 for name in params}
    unexpected: list[str] = []
    bad_shapes: list[str] = []
    duplicates: list[str] = []
    seen: set[tuple[str, int | None, tuple[int, int] | None]] = set()  # (param, expert, shard) pieces
    # Per written float tensor, whether it is finite in the model's dtype (a NaN in the file, or a
    # value beyond float16's range): device flags, read back once at the end (no sync per tensor).
    finite: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for hf_name, source in weights:
            if is_kv_scale_tensor(hf_name):  # fp8 KV-cache scales: the engine's (models/kv_scales.py)
                continue
            try:
                target = mapper.target(hf_name)
            except KeyError:
                unexpected.append(hf_name)
                continue
            if target is None:
                continue
            name, expert, rule = target
            if name not in params:
                unexpected.append(f"{hf_name} (-> {name})")
                continue
            if (name, expert, rule.shard) in seen:  # one piece twice would leave another piece unwritten
                duplicates.append(f"{hf_name} (-> {name})")
                continue
            seen.add((name, expert, rule.shard))
            dest = params[name]
            if expert is not None and shards is not None and shards.experts is not None:
                first, count = shards.experts
                if not first <= expert < first + count:  # another rank's expert: never read
                    continue
                expert -= first
            if expert is not None:
                if not 0 <= expert < dest.shape[0]:
                    unexpected.append(f"{hf_name} (expert {expert} of {dest.shape[0]})")
                    continue
                dest = dest[expert]
            if rule.shard is not None:
                dest = dest[rule.shard_rows(dest.shape[0])]
            # A rank's expert is whole: splits cut the other parameters (and stacked experts).
            split = None if shards is None or expert is not None else shards.split(name, rule.shard)
            tensor = _read(source, split)
            if dest.shape != tensor.shape:
                bad_shapes.append(f"{hf_name}: checkpoint {tuple(tensor.shape)}, model {tuple(dest.shape)}")
                continue
            dest.copy_(tensor)
            written[name] += dest.numel()
            if dest.is_floating_point():
                finite.append((hf_name, torch.isfinite(dest).all()))
    missing = [f"{n} ({w} of {params[n].numel()} elements)"
               for n, w in written.items() if w != params[n].numel()]
    problems = []
    if unexpected:
        problems.append("unexpected checkpoint tensors: " + ", ".join(sorted(unexpected)))
    if bad_shapes:
        problems.append("shape mismatches: " + "; ".join(bad_shapes))
    if duplicates:
        problems.append("tensors written twice: " + ", ".join(sorted(duplicates)))
    if missing:
        problems.append("parameters not written exactly once: " + ", ".join(sorted(missing)))
    if finite:
        flags = torch.stack([flag for _, flag in finite]).tolist()
        non_finite = [hf_name for (hf_name, _), ok in zip(finite, flags, strict=True) if not ok]
        if non_finite:
            dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
            problems.append(f"NaN or infinite values in {dtype} (in the file, or beyond {dtype}'s range): "
                            + ", ".join(sorted(non_finite)))
    if problems:
        raise ValueError("the checkpoint does not match the model its config.json describes:\n  "
                         + "\n  ".join(problems))
