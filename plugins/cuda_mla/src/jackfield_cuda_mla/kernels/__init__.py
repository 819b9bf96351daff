"""Triton kernels for MLA: KV insert, split-KV absorbed decode (dense and sparse top-k)."""

from jackfield_cuda_mla.kernels.decode import mla_decode
from jackfield_cuda_mla.kernels.kv_insert import mla_kv_insert

__all__ = ["mla_decode", "mla_kv_insert"]
