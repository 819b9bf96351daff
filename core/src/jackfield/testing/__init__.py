"""What backend and model authors test with, shipped with jackfield.

- `AttentionConformance` (conformance.py, harness.py, checks.py): a backend against torch_ref,
  generated from its capability record;
- problems.py: random paged-attention problems, and the expanded-MLA float64 reference;
- checkpoints.py: tiny random checkpoints of the built-in families, written by transformers;
- paged.py: a Jackfield model run by hand over paged caches;
- accuracy.py: a run's logprob errors against a float32 reference at every prompt position;
- pytest_plugin.py (entry point `jackfield`): the `gpu` marker and per-test seeds.
The float64 oracle itself is `jackfield.ops.reference`.

Imported lazily: the pytest plugin loads at every pytest start and must not pull in torch or the
backends.
"""

from __future__ import annotations

__all__ = ["AttentionConformance"]


def __getattr__(name: str) -> object:
    if name == "AttentionConformance":
        from jackfield.testing.conformance import AttentionConformance

        return AttentionConformance
    raise AttributeError(f"module 'jackfield.testing' has no attribute {name!r}")
