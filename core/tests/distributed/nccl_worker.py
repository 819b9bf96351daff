"""The NCCL collectives DCP runs, at world size 1 (one GPU): `gather_heads` and
`merge_over_ranks` through NCCL against the one-process merge. Run by torchrun with one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from jackfield.distributed.cp_common import ParallelGroups
from jackfield.distributed.dcp import gather_heads, merge_over_ranks, merge_partials

SEED = 5151


def main() -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    world = dist.group.WORLD
    groups = ParallelGroups(tp_size=1, dcp_size=1, tp_group=world, dcp_group=world)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    for t, h, d in ((4, 64, 512), (1, 8, 64), (42, 28, 320), (1111, 28, 576), (1024, 128, 512)):
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.randn(t, h, d, device="cuda", generator=gen).to(dtype)
            assert torch.equal(gather_heads(q, groups), q)
            out = torch.randn(t, h, d, device="cuda", generator=gen).to(dtype)
            lse = torch.randn(t, h, device="cuda", generator=gen) * 4
            lse[0, 0], out[0, 0] = float("-inf"), float("nan")  # a row with no key here
            merged = merge_over_ranks(out, lse, groups)
            want = merge_partials(out[None], lse[None]).to(dtype)
            assert torch.equal(merged, want), (t, h, d, dtype)
            assert torch.equal(merged[0, 0], torch.zeros_like(merged[0, 0]))
    dist.destroy_process_group()
    print("nccl collectives ok")


if __name__ == "__main__":
    main()
