"""`[kv_connector] options` of cpu_offload, checked once with every problem named by its key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "kv_connector.options"
POLICIES = ("lru", "arc")


@dataclass(frozen=True)
class OffloadOptions:
    cpu_bytes: int  # the CPU tier's budget (whole chunks of it are used)
    blocks_per_chunk: int = 4  # engine KV blocks per stored chunk (the unit of lookup and transfer)
    eviction_policy: str = "lru"
    store_threshold: int = 1  # store a chunk once requests have looked it up this many times


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_options(options: Mapping[str, object]) -> list[str]:
    """Every problem of `options` that shows without the model (the CPU budget against one
    chunk's size is checked when the connector is built)."""
    known = {"cpu_bytes", "cpu_gib", "blocks_per_chunk", "eviction_policy", "store_threshold"}
    problems = [f"{PREFIX}.{key}: unknown option (valid: {', '.join(sorted(known))})"
                for key in options if key not in known]
    if "cpu_bytes" in options and "cpu_gib" in options:
        problems.append(f"{PREFIX}: give cpu_bytes or cpu_gib, not both")
    cpu_bytes, cpu_gib = options.get("cpu_bytes"), options.get("cpu_gib")
    if cpu_bytes is not None and not (_integer(cpu_bytes) and cpu_bytes > 0):  # type: ignore[operator]
        problems.append(f"{PREFIX}.cpu_bytes must be a positive integer, got {cpu_bytes!r}")
    if cpu_gib is not None and not (isinstance(cpu_gib, int | float) and not isinstance(cpu_gib, bool)
                                    and 0 < cpu_gib <= 2**33):
        problems.append(f"{PREFIX}.cpu_gib must be a number in (0, 2**33], got {cpu_gib!r}")
    blocks = options.get("blocks_per_chunk", 4)
    if not (_integer(blocks) and blocks >= 1):  # type: ignore[operator]
        problems.append(f"{PREFIX}.blocks_per_chunk must be an integer >= 1, got {blocks!r}")
    policy = options.get("eviction_policy", "lru")
    if policy not in POLICIES:
        problems.append(f"{PREFIX}.eviction_policy must be one of {', '.join(map(repr, POLICIES))}, "
                        f"got {policy!r}")
    threshold = options.get("store_threshold", 1)
    if not (_integer(threshold) and threshold >= 1):  # type: ignore[operator]
        problems.append(f"{PREFIX}.store_threshold must be an integer >= 1, got {threshold!r}")
    return problems


def parse_options(options: Mapping[str, object]) -> OffloadOptions:
    """The options as a record; ValueError listing every problem. Default budget: 4 GiB."""
    problems = check_options(options)
    if problems:
        raise ValueError("\n".join(problems))
    if "cpu_bytes" in options:
        cpu_bytes = int(options["cpu_bytes"])  # type: ignore[call-overload]
    else:
        cpu_bytes = int(float(options.get("cpu_gib", 4.0)) * 2**30)  # type: ignore[arg-type]
    return OffloadOptions(cpu_bytes, int(options.get("blocks_per_chunk", 4)),  # type: ignore[call-overload]
                          str(options.get("eviction_policy", "lru")),
                          int(options.get("store_threshold", 1)))  # type: ignore[call-overload]
