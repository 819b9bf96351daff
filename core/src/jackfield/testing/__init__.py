"""Conformance kit for backend authors: `AttentionConformance` and random paged problems.

Imported lazily: the pytest plugin (`jackfield.testing.pytest_plugin`) loads at every pytest start
and must not pull in torch or the backends.
"""

from __future__ import annotations

__all__ = ["AttentionConformance"]


def __getattr__(name: str) -> object:
    if name == "AttentionConformance":
        from jackfield.testing.conformance import AttentionConformance

        return AttentionConformance
    raise AttributeError(f"module 'jackfield.testing' has no attribute {name!r}")
