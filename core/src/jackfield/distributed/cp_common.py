"""The parallel groups of one process, set up from torchrun's environment, and the capability
gate of decode context parallelism (DCP).

torchrun starts `parallel.tensor_parallel_size` processes and gives each RANK, WORLD_SIZE,
LOCAL_RANK and a rendezvous (MASTER_ADDR / MASTER_PORT); `init_parallel` joins them into one
process group (NCCL on GPUs, gloo on CPUs). The tensor-parallel group is every rank. DCP reuses
those ranks, as vLLM does: consecutive runs of `dcp_size` ranks form the DCP groups, each of
which holds one copy of every request's KV cache between its members, for the query heads of
its members (`head_group`).

The groups are process-wide (`parallel_state()`): the engine sets them before it builds the
model, and the model's layers read them when they are built. One process never holds two
engines of different parallel shapes at once.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from jackfield.config import ConfigError, ParallelConfig
from jackfield.contracts.attention import AttentionRequirements
from jackfield.plugins import Registry

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ParallelGroups:
    """This process's place in the tensor-parallel and DCP groups (the defaults: one process)."""

    tp_size: int = 1
    tp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    local_rank: int = 0
    tp_group: dist.ProcessGroup | None = None  # None: no collectives (one process)
    dcp_group: dist.ProcessGroup | None = None

    @property
    def num_head_groups(self) -> int:
        """Attention heads are split in this many groups: every DCP group holds one."""
        return self.tp_size // self.dcp_size

    @property
    def head_group(self) -> int:
        """The head group of this rank's DCP group (its ranks' query heads, together)."""
        return self.tp_rank // self.dcp_size


_current = ParallelGroups()


def parallel_state() -> ParallelGroups:
    """This process's groups (one process unless `init_parallel` joined a torchrun group)."""
    return _current


def is_output_rank() -> bool:
    """Whether this process prints: the only one, or torchrun's rank 0."""
    return os.environ.get("RANK", "0") == "0"


def init_parallel(parallel: ParallelConfig, device_type: str) -> ParallelGroups:
    """Join the torchrun group `parallel` asks for (or check that none is asked for) and make it
    this process's `parallel_state()`. A process group already initialized (by the caller's own
    program, or an earlier engine of this process) of the right size is reused."""
    global _current
    tp, dcp = parallel.tensor_parallel_size, parallel.dcp_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp == 1:
        if world > 1:
            raise ConfigError([f"started by torchrun with {world} processes but "
                               "parallel.tensor_parallel_size is 1: set it to the number of processes"])
        _current = ParallelGroups()
        return _current
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError([f"parallel.tensor_parallel_size = {tp} runs one process per rank, started by "
                           f"torchrun (`torchrun --nproc-per-node {tp} -m jackfield.cli run ...`); "
                           f"{', '.join(missing)} not set"])
    if world != tp:
        raise ConfigError([f"parallel.tensor_parallel_size = {tp} but torchrun started {world} processes"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        atexit.register(_destroy)
    elif dist.get_world_size() != tp:
        raise ConfigError([f"the process group has {dist.get_world_size()} ranks, "
                           f"parallel.tensor_parallel_size is {tp}"])
    rank = dist.get_rank()
    dcp_group = None
    # Every rank creates every DCP group, in the same order (torch.distributed requires it).
    for first in range(0, tp, dcp):
        group = dist.new_group(list(range(first, first + dcp))) if dcp > 1 else None
        if first <= rank < first + dcp:
            dcp_group = group
    _current = ParallelGroups(tp_size=tp, tp_rank=rank, dcp_size=dcp, dcp_rank=rank % dcp,
                              dcp_interleave=parallel.dcp_interleave, local_rank=local_rank,
                              tp_group=dist.group.WORLD, dcp_group=dcp_group)
    return _current


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def dcp_backends(registry: Registry) -> list[str]:
    """The installed attention backends whose capability record says dcp (they return the LSE)."""
    return [name for name in registry.names("attention")
            if registry.lookup("attention", name).spec.capabilities.dcp]  # type: ignore[attr-defined]


def dcp_gate(parallel: ParallelConfig, backend_names: dict[str, str], registry: Registry) -> list[str]:
    """Fail closed: under DCP (dcp_size > 1) each named backend (role -> name, "auto" passes:
    selection then only picks backends with dcp) must declare dcp; the refusal lists those that do."""
    if parallel.dcp_size == 1:
        return []
    have = dcp_backends(registry)
    problems = []
    for role, name in backend_names.items():
        if name != "auto" and name not in have:
            problems.append(f"{role} attention backend {name!r} does not declare dcp (decode context "
                            "parallel needs each rank's LSE); installed backends that do: "
                            f"{', '.join(have) or 'none'}")
    return problems


def parallel_problems(parallel: ParallelConfig, requirements: AttentionRequirements,
                      block_size: int | None) -> list[str]:
    """The model features this engine does not run split over ranks (not verified), each with
    the reason, and a DCP interleave the block size does not take."""
    problems = []
    if parallel.tensor_parallel_size > 1 and requirements.non_causal:
        problems.append("bidirectional (embedding) models under tensor parallelism are not verified: run "
                        "them with parallel.tensor_parallel_size = 1")
    if parallel.dcp_size > 1:
        for feature, what in (("sliding_window", "sliding-window layers"),
                              ("sinks", "attention sinks (they join one softmax, not each rank's)"),
                              ("sparse_topk", "sparse attention (DeepSeek-V3.2's indexer reads every key)")):
            if getattr(requirements, feature):
                problems.append(f"{what} under decode context parallel are not verified: run with "
                                "parallel.dcp_size = 1")
        if block_size is not None and block_size % parallel.dcp_interleave:
            problems.append(f"parallel.dcp_interleave {parallel.dcp_interleave} must divide the block size "
                            f"{block_size}")
    return problems
