"""Seeded sampling: Murmur3 noise and the Gumbel-max sampler (PyTorch and Triton)."""

from jackfield.sampling.noise import (
    DRAFT_POSITION_OFFSET,
    gumbel_noise,
    log1p_neg_stable,
    murmur3_hash32,
    murmur3_uniform32,
    murmur3_uniform64,
)
from jackfield.sampling.sample import sample

__all__ = [
    "DRAFT_POSITION_OFFSET",
    "gumbel_noise",
    "log1p_neg_stable",
    "murmur3_hash32",
    "murmur3_uniform32",
    "murmur3_uniform64",
    "sample",
]
