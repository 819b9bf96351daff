"""Attention backend selection: an explicit name is a hard requirement; `auto` takes the
highest-priority backend whose validate() is empty. Every rejection keeps all of its reasons."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

from jackfield.config import JackfieldConfig
from jackfield.contracts.attention import (
    AttentionBackend,
    AttentionRequirements,
    Availability,
    capability_mismatches,
)
from jackfield.plugins import PluginFault, Registered, Registry, get_registry
from jackfield.specs import AttentionBackendSpec, resolve_factory

log = logging.getLogger("jackfield.selection")


class SelectionError(ValueError):
    """No backend can serve a role; the message lists every reason."""


@dataclass(frozen=True)
class BackendChoice:
    role: str
    name: str
    backend: type[AttentionBackend]
    reason: str
    rejected: dict[str, list[str]] = field(default_factory=dict)


def spec_reasons(spec: AttentionBackendSpec, req: AttentionRequirements) -> list[str]:
    """Reasons from the cheap record (capabilities + probe), without importing kernels."""
    reasons = capability_mismatches(spec.capabilities, req)
    probe = run_probe(spec)
    if not probe.ok:
        reasons.append(f"unavailable: {probe.reason}")
    return reasons


def run_probe(spec: AttentionBackendSpec) -> Availability:
    """The spec's availability probe; a probe that raises (or exits) or answers something other
    than an Availability makes its backend unavailable, with that as the reason."""
    try:
        probe = spec.availability()
    except PluginFault as exc:
        return Availability.no(f"availability probe raised {type(exc).__name__}: {exc}")
    if not isinstance(probe, Availability):
        return Availability.no(f"availability probe returned {probe!r:.80}, not an Availability")
    return probe


def _candidate_reasons(entry: Registered, req: AttentionRequirements,
                       ) -> tuple[list[str], type[AttentionBackend] | None]:
    spec = entry.spec
    assert isinstance(spec, AttentionBackendSpec)
    reasons = spec_reasons(spec, req)
    if reasons:
        return reasons, None
    try:
        backend = resolve_factory(spec.factory)
    except PluginFault as exc:  # an import error of a backend module is a reason, not a crash
        return [f"failed to import {spec.factory}: {type(exc).__name__}: {exc}"], None
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        return [f"{spec.factory} is not an AttentionBackend subclass"], None
    try:
        reasons = backend.validate(req)
    except PluginFault as exc:
        return [f"validate() raised {type(exc).__name__}: {exc}"], None
    if not (isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)):
        return [f"validate() returned {reasons!r:.80}, not a list of reasons"], None
    return reasons, backend


def _format_rejections(rejected: dict[str, list[str]]) -> list[str]:
    return [f"  {name}: " + "; ".join(reasons) for name, reasons in sorted(rejected.items())]


def select_attention_backend(
    requirements: AttentionRequirements,
    choice: str = "auto",
    role: str = "target",
    registry: Registry | None = None,
) -> BackendChoice:
    registry = registry or get_registry()
    table = registry.entries.get("attention", {})
    rejected: dict[str, list[str]] = {}
    if choice != "auto":
        if choice not in table:
            try:
                registry.lookup("attention", choice)
            except KeyError as exc:
                raise SelectionError(f"{role}: attention backend {choice!r} is not available:\n"
                                     f"{exc.args[0]}") from None
        reasons, backend = _candidate_reasons(table[choice], requirements)
        if backend is not None and not reasons:
            return BackendChoice(role, choice, backend, "named in the config")
        working = [
            name for name, entry in sorted(table.items())
            if name != choice and not _candidate_reasons(entry, requirements)[0]
        ]
        raise SelectionError(
            f"{role}: attention backend {choice!r} cannot serve this model here:\n"
            + "\n".join(f"  - {r}" for r in reasons)
            + f"\ninstalled backends that would work: {', '.join(working) or 'none'}"
        )
    ranked = sorted(table.items(), key=lambda item: (-item[1].spec.priority, item[0]))  # type: ignore[union-attr]
    for name, entry in ranked:
        reasons, backend = _candidate_reasons(entry, requirements)
        if backend is not None and not reasons:
            why = f"auto: highest-priority valid backend (priority {entry.spec.priority})"  # type: ignore[union-attr]
            picked = BackendChoice(role, name, backend, why, rejected)
            log.info("%s attention: %s (%s)", role, name, why)
            for other, other_reasons in rejected.items():
                log.info("%s attention: rejected %s: %s", role, other, "; ".join(other_reasons))
            return picked
        rejected[name] = reasons
    raise SelectionError(
        f"{role}: no installed attention backend can serve this model here:\n"
        + "\n".join(_format_rejections(rejected))
    )


def resolve_attention(config: JackfieldConfig,
                      requirements: AttentionRequirements) -> dict[str, BackendChoice]:
    """Backends for the target model's prefill and decode roles (the same one unless the
    config names different ones). Raises one SelectionError listing every role's problems."""
    att = config.attention
    choices: dict[str, BackendChoice] = {}
    problems: list[str] = []
    for role, named in (("prefill", att.prefill_backend), ("decode", att.decode_backend)):
        try:
            role_requirements = requirements_for_role(requirements, role)
            choices[role] = select_attention_backend(role_requirements, named or att.backend, role)
        except SelectionError as exc:
            problems.append(str(exc))
    if problems:
        raise SelectionError("\n".join(problems))
    return choices


def pick_block_size(decode: type[AttentionBackend], prefill: type[AttentionBackend]) -> int:
    """The KV block size when the config leaves it open: the decode backend's preferred size
    (decode reads the whole cache every step: its kernels' page size matters most), else the
    prefill backend's, else 16 (vLLM's default), whichever both backends' multiples allow; if
    none does, the smallest size both allow."""
    multiples = (decode.capabilities.block_size_multiple, prefill.capabilities.block_size_multiple)
    for size in (decode.capabilities.preferred_block_size, prefill.capabilities.preferred_block_size, 16):
        if size and all(size % m == 0 for m in multiples):
            return size
    return math.lcm(*multiples)


def requirements_for_role(requirements: AttentionRequirements, role: str) -> AttentionRequirements:
    """Prefill never needs multi-token decode support; decode keeps the full requirement."""
    return replace(requirements, max_decode_query_len=1) if role == "prefill" else requirements
