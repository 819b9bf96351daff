"""Attention impl bases (MLA, MHA), paged-cache layouts, and the torch_ref reference backend."""

from jackfield.attention.kv_cache import allocate_kv_cache, cache_dtype, cache_shape
from jackfield.attention.metadata import split_decode_prefill
from jackfield.attention.mha import MHAImpl
from jackfield.attention.mla import MLAImpl

__all__ = ["MHAImpl", "MLAImpl", "allocate_kv_cache", "cache_dtype", "cache_shape", "split_decode_prefill"]
