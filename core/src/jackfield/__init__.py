"""Jackfield: a plugin-based backend framework for LLM inference."""

from jackfield.contracts.sampler import SamplingParams
from jackfield.hookspecs import hookimpl
from jackfield.plugins import API_VERSION

__version__ = "0.1.0"
__all__ = ["API_VERSION", "LLM", "SamplingParams", "__version__", "hookimpl"]


def __getattr__(name: str) -> object:
    # The engine imports models and transformers: keep `import jackfield` light for plugins.
    if name == "LLM":
        from jackfield.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'jackfield' has no attribute {name!r}")
