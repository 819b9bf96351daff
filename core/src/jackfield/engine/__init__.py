"""The engine: LLM facade, scheduler, paged KV blocks, model runner."""

from jackfield.engine.llm import LLM
from jackfield.engine.outputs import RequestOutput, RequestTimings

__all__ = ["LLM", "RequestOutput", "RequestTimings"]
