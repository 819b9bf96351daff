"""Plugin manager: entry points and built-ins through the same hooks, listing, conflicts, controls.

Every process that needs plugins calls `get_registry()`; loading happens once per process.
Environment controls (names match an entry-point name or a distribution name):
  JACKFIELD_PLUGINS=a,b                 only these third-party plugins load
  JACKFIELD_DISABLE_PLUGINS=a,b         these do not load
  JACKFIELD_DISABLE_PLUGIN_AUTOLOAD=1   no entry point is loaded (each is listed as disabled)
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from jackfield import hookspecs
from jackfield.config import _closest
from jackfield.specs import SPEC_TYPES, AnySpec

API_VERSION = "1.0"
ENTRY_POINT_GROUP = "jackfield"
BUILTIN_DISTRIBUTION = "jackfield"

PluginStatus = Literal["active", "failed", "disabled", "incompatible"]


class PluginConflictError(RuntimeError):
    """Two providers registered one name without `replaces=`."""


@dataclass(frozen=True)
class Registered:
    kind: str  # attention | sampler | drafter | kv_connector | model
    spec: AnySpec
    plugin: str
    distribution: str


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    status: PluginStatus
    reason: str = ""
    registers: list[str] = field(default_factory=list)


@dataclass
class Registry:
    """Everything the loaded plugins registered, by kind then name."""

    plugins: list[PluginInfo]
    entries: dict[str, dict[str, Registered]]
    replaced: list[tuple[Registered, Registered]]  # (replaced, replacement)

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries.get(kind, {}))

    def lookup(self, kind: str, name: str) -> Registered:
        """The entry `name` of `kind`; a miss lists valid names and any failed plugin."""
        found = self.entries.get(kind, {}).get(name)
        if found is not None:
            return found
        lines = [f"no {kind} named {name!r}; registered: {', '.join(self.names(kind)) or 'none'}"]
        for info in self.plugins:
            if info.status in ("failed", "incompatible"):
                lines.append(f"plugin {info.name!r} ({info.distribution}) is {info.status}: {info.reason}")
            elif info.status == "disabled":
                lines.append(f"plugin {info.name!r} ({info.distribution}) is disabled: {info.reason}")
        raise KeyError("\n".join(lines))


def _split_env(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _disabled_reason(ep_name: str, dist_name: str) -> str | None:
    names = {ep_name, dist_name}
    if os.environ.get("JACKFIELD_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0"):
        return "JACKFIELD_DISABLE_PLUGIN_AUTOLOAD is set"
    allow = _split_env("JACKFIELD_PLUGINS")
    if allow is not None and not names & allow:
        return "not in JACKFIELD_PLUGINS"
    block = _split_env("JACKFIELD_DISABLE_PLUGINS") or set()
    if names & block:
        return "listed in JACKFIELD_DISABLE_PLUGINS"
    return None


def _incompatible_reason(module: ModuleType) -> str | None:
    declared = getattr(module, "JACKFIELD_API", None)
    if declared is None:
        return f"declares no JACKFIELD_API range (core API is {API_VERSION})"
    try:
        ok = SpecifierSet(str(declared)).contains(API_VERSION)
    except InvalidSpecifier as exc:
        return f"JACKFIELD_API {declared!r} is not a version range: {exc}"
    return None if ok else f"supports core API {declared}, this core is {API_VERSION}"


# Whatever a plugin does wrong while it is imported, probed or called (SystemExit included: a
# plugin calling sys.exit must not end the process) fails that plugin alone.
PluginFault = (Exception, SystemExit)


@dataclass(frozen=True)
class _Found:
    """One entry point of group "jackfield", with the distribution that declares it."""

    entry_point: md.EntryPoint
    distribution: str
    version: str


def _reason(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())  # pluggy's messages span lines


def _group_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the [jackfield] section of an entry_points.txt."""
    lines, inside = [], False
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            inside = line == f"[{ENTRY_POINT_GROUP}]"
            continue
        if inside:
            lines.append((number, line))
    return lines


def _discover() -> tuple[list[_Found], list[PluginInfo]]:
    """Entry points read one distribution at a time (not `md.entry_points`, which fails for all when
    one installed distribution has a malformed entry_points.txt), with the failures found on the way.
    As importlib.metadata does, the first distribution of a name on sys.path wins."""
    found: list[_Found] = []
    failed: list[PluginInfo] = []
    seen: set[str] = set()
    for dist in md.distributions():
        try:
            text = dist.read_text("entry_points.txt") or ""
        except (OSError, UnicodeDecodeError):
            continue  # unreadable, so it declares no plugin of ours
        if f"[{ENTRY_POINT_GROUP}]" not in text:
            continue
        try:
            metadata = dist.metadata
        except (OSError, TypeError, ValueError):  # no METADATA file at all (Python 3.11 raises TypeError)
            metadata = None
        name = metadata["Name"] if metadata is not None else None
        version = (metadata["Version"] if metadata is not None else None) or "unknown"
        if not name:
            where = getattr(dist, "_path", None) or dist.locate_file("")  # the .dist-info folder when known
            reason = f"{where}: METADATA has no Name; its jackfield entry points are not loaded"
            failed.append(PluginInfo(f"<{where}>", "<no name>", version, "failed", reason))
            continue
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        for number, line in _group_lines(text):
            ep_name, sep, value = (part.strip() for part in line.partition("="))
            if not sep or not ep_name or not value:
                failed.append(PluginInfo(ep_name or line, name, version, "failed",
                                         f"entry_points.txt line {number} {line!r} is not 'name = module'"))
                continue
            found.append(_Found(md.EntryPoint(ep_name, value, ENTRY_POINT_GROUP), name, version))
    return found, failed


def _collect(pm: pluggy.PluginManager, module: object, info: PluginInfo) -> list[Registered]:
    """Call each of the module's hookimpls, attributing every record to this plugin; a result that
    is not an iterable of the hook's own record type fails the plugin."""
    records: list[Registered] = []
    for hook_name, kind in hookspecs.HOOK_KINDS.items():
        expected = SPEC_TYPES[kind]
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is not module:
                continue
            result = impl.function()
            if result is None:
                continue
            if isinstance(result, str | bytes | Mapping) or not isinstance(result, Iterable):
                raise TypeError(f"{hook_name} returned {result!r:.80}, not a list of {expected.__name__}")
            for spec in result:
                if not isinstance(spec, expected):
                    raise TypeError(f"{hook_name} returned {spec!r:.80}, not a {expected.__name__}")
                records.append(Registered(kind, spec, info.name, info.distribution))
    return records


def _unknown_hooks(pm: pluggy.PluginManager, module: object) -> list[str]:
    """The module's hookimpls whose names match no hookspec (pluggy would keep them, never called)."""
    return sorted(caller.name for caller in pm.get_hookcallers(module) or () if caller.spec is None)


def load_registry(entry_points: Iterable[md.EntryPoint] | None = None) -> Registry:
    """Load built-ins and entry-point plugins into a fresh registry (see `get_registry`). A plugin
    that fails in any way is listed as failed with the reason, and the others still load."""
    from jackfield import builtins

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    plugins: list[PluginInfo] = []
    records: list[Registered] = []

    def add(module: ModuleType, info: PluginInfo) -> None:
        try:
            pm.register(module, name=info.name)  # pluggy checks each hookimpl's signature here
        except PluginFault as exc:
            info.status, info.reason = "failed", _reason(exc)
            return
        try:
            unknown = _unknown_hooks(pm, module)
            if unknown:
                hooks = list(hookspecs.HOOK_KINDS)
                raise TypeError("; ".join(f"hookimpl {name!r} matches no hookspec{_closest(name, hooks)}"
                                          for name in unknown))
            found = _collect(pm, module, info)
        except PluginFault as exc:
            pm.unregister(module)
            info.status, info.reason = "failed", _reason(exc)
            return
        info.registers = [f"{r.kind}:{r.spec.name}" for r in found]
        records.extend(found)

    builtin = PluginInfo("builtins", BUILTIN_DISTRIBUTION, _version(BUILTIN_DISTRIBUTION), "active")
    plugins.append(builtin)
    add(builtins, builtin)

    if entry_points is None:
        found, failed = _discover()
        plugins.extend(failed)
    else:
        found = [_Found(ep, ep.dist.name, _version(ep.dist.name)) if ep.dist is not None and ep.dist.name
                 else _Found(ep, ep.name, "unknown") for ep in entry_points]
    for item in found:
        ep = item.entry_point
        info = PluginInfo(ep.name, item.distribution, item.version, "active")
        plugins.append(info)
        disabled = _disabled_reason(ep.name, item.distribution)
        if disabled:
            info.status, info.reason = "disabled", disabled
            continue
        try:
            module = ep.load()
            incompatible = _incompatible_reason(module)
        except PluginFault as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1:]
            where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
            info.status, info.reason = "failed", f"{_reason(exc)}{where}"
            continue
        if incompatible:
            info.status, info.reason = "incompatible", incompatible
            continue
        add(module, info)

    entries, replaced = _resolve(records)
    return Registry(plugins, entries, replaced)


def _resolve(records: list[Registered],
             ) -> tuple[dict[str, dict[str, Registered]], list[tuple[Registered, Registered]]]:
    entries: dict[str, dict[str, Registered]] = {kind: {} for kind in hookspecs.HOOK_KINDS.values()}
    replacing = [r for r in records if r.spec.replaces]
    for record in (r for r in records if not r.spec.replaces):
        table = entries[record.kind]
        other = table.get(record.spec.name)
        if other is not None:
            raise PluginConflictError(
                f"{record.kind} {record.spec.name!r} is registered by both "
                f"{other.distribution} (plugin {other.plugin!r}) and {record.distribution} "
                f"(plugin {record.plugin!r}); uninstall or disable one (JACKFIELD_DISABLE_PLUGINS), "
                "or declare replaces= in the overriding spec"
            )
        table[record.spec.name] = record
    replaced: list[tuple[Registered, Registered]] = []
    claimed: dict[tuple[str, str], Registered] = {}
    for record in replacing:
        table = entries[record.kind]
        target = str(record.spec.replaces)
        key = (record.kind, target)
        if key in claimed:
            first = claimed[key]
            raise PluginConflictError(
                f"{record.kind} {target!r} is replaced by both {first.distribution} "
                f"(plugin {first.plugin!r}) and {record.distribution} (plugin {record.plugin!r})"
            )
        if target not in table:
            raise PluginConflictError(
                f"{record.distribution} (plugin {record.plugin!r}) replaces {record.kind} {target!r}, "
                f"which nothing registers; registered: {', '.join(sorted(table)) or 'none'}"
            )
        claimed[key] = record
        replaced.append((table.pop(target), record))
        if record.spec.name in table:
            other = table[record.spec.name]
            raise PluginConflictError(
                f"{record.kind} {record.spec.name!r} is registered by both {other.distribution} "
                f"and {record.distribution}"
            )
        table[record.spec.name] = record
    return entries, replaced


def _version(dist_name: str) -> str:
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return "unknown"


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use (idempotent; workers call it too)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = load_registry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the loaded registry (tests, or after changing the environment controls)."""
    global _REGISTRY
    _REGISTRY = None

