"""`[kv_connector] options` of cpu_offload and pd, checked once with every problem named by its key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "kv_connector.options"
POLICIES = ("lru", "arc")
LOAD_MODES = ("layerwise", "async")


@dataclass(frozen=True)
class OffloadOptions:
    cpu_bytes: int  # the CPU tier's budget (whole chunks of it are used)
    blocks_per_chunk: int = 4  # engine KV blocks per stored chunk (the unit of lookup and transfer)
    eviction_policy: str = "lru"
    store_threshold: int = 1  # store a chunk once requests have looked it up this many times
    # "layerwise": a hit is loaded in the step that computes the request's new tokens, each layer
    # waiting for its own copy (time to first token); "async": the request waits a step for its
    # load while the others run without waiting on the copy
    load_mode: str = "layerwise"


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unknown(options: Mapping[str, object], known: set[str]) -> list[str]:
    return [f"{PREFIX}.{key}: unknown option (valid: {', '.join(sorted(known))})"
            for key in options if key not in known]


def _budget_problems(options: Mapping[str, object]) -> list[str]:
    problems = []
    if "cpu_bytes" in options and "cpu_gib" in options:
        problems.append(f"{PREFIX}: give cpu_bytes or cpu_gib, not both")
    cpu_bytes, cpu_gib = options.get("cpu_bytes"), options.get("cpu_gib")
    if cpu_bytes is not None and not (_integer(cpu_bytes) and cpu_bytes > 0):  # type: ignore[operator]
        problems.append(f"{PREFIX}.cpu_bytes must be a positive integer, got {cpu_bytes!r}")
    if cpu_gib is not None and not (isinstance(cpu_gib, int | float) and not isinstance(cpu_gib, bool)
                                    and 0 < cpu_gib <= 2**33):
        problems.append(f"{PREFIX}.cpu_gib must be a number in (0, 2**33], got {cpu_gib!r}")
    return problems


def _budget_bytes(options: Mapping[str, object]) -> int:
    """The CPU budget in bytes (default 4 GiB); the options passed `_budget_problems`."""
    if "cpu_bytes" in options:
        return int(options["cpu_bytes"])  # type: ignore[call-overload]
    return int(float(options.get("cpu_gib", 4.0)) * 2**30)  # type: ignore[arg-type]


def check_options(options: Mapping[str, object]) -> list[str]:
    """Every problem of `options` that shows without the model (the CPU budget against one
    chunk's size is checked when the connector is built)."""
    known = {"cpu_bytes", "cpu_gib", "blocks_per_chunk", "eviction_policy", "store_threshold", "load_mode"}
    problems = _unknown(options, known) + _budget_problems(options)
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
    mode = options.get("load_mode", "layerwise")
    if mode not in LOAD_MODES:
        problems.append(f"{PREFIX}.load_mode must be one of {', '.join(map(repr, LOAD_MODES))}, got {mode!r}")
    return problems


def parse_options(options: Mapping[str, object]) -> OffloadOptions:
    """The options as a record; ValueError listing every problem. Default budget: 4 GiB."""
    problems = check_options(options)
    if problems:
        raise ValueError("\n".join(problems))
    return OffloadOptions(_budget_bytes(options), int(options.get("blocks_per_chunk", 4)),  # type: ignore[call-overload]
                          str(options.get("eviction_policy", "lru")),
                          int(options.get("store_threshold", 1)),  # type: ignore[call-overload]
                          str(options.get("load_mode", "layerwise")))


PD_ROLES = ("producer", "consumer")


@dataclass(frozen=True)
class PDOptions:
    role: str  # "producer": the prefill engine, exports KV; "consumer": the decode engine, loads it
    address: str  # host:port of the rendezvous, served by the consumer
    cpu_bytes: int  # consumer: host memory for chunks that arrived and wait for their request
    timeout_s: float = 30.0  # a load waiting longer for its chunks fails (the consumer recomputes)
    connect_timeout_s: float = 600.0  # for the other engine to start and join (it may be loading)


def _positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def check_pd_options(options: Mapping[str, object]) -> list[str]:
    """Every problem of pd's `options` (the CPU budget against one block is checked at start-up)."""
    known = {"role", "address", "timeout_s", "connect_timeout_s", "cpu_bytes", "cpu_gib"}
    problems = _unknown(options, known) + _budget_problems(options)
    role = options.get("role")
    if role not in PD_ROLES:
        problems.append(f"{PREFIX}.role must be one of {', '.join(map(repr, PD_ROLES))}, got {role!r}")
    address = options.get("address")
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        problems.append(f"{PREFIX}.address must be \"host:port\" (the consumer listens there), "
                        f"got {address!r}")
    for key, default in (("timeout_s", 30.0), ("connect_timeout_s", 600.0)):
        if not _positive_number(options.get(key, default)):
            problems.append(f"{PREFIX}.{key} must be a number of seconds > 0, got {options[key]!r}")
    return problems


def parse_pd_options(options: Mapping[str, object]) -> PDOptions:
    """pd's options as a record; ValueError listing every problem."""
    problems = check_pd_options(options)
    if problems:
        raise ValueError("\n".join(problems))
    return PDOptions(str(options["role"]), str(options["address"]), _budget_bytes(options),
                     float(options.get("timeout_s", 30.0)),  # type: ignore[arg-type]
                     float(options.get("connect_timeout_s", 600.0)))  # type: ignore[arg-type]
