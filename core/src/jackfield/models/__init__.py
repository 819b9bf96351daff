"""Model families, looked up by the checkpoint's `architectures` entry in the plugin registry."""

from __future__ import annotations

from pathlib import Path

import torch

from jackfield.contracts.attention import AttentionBackends, KVCacheDType
from jackfield.contracts.model import ModelFamily
from jackfield.model_files import ModelFileError
from jackfield.models.hf_config import architecture_of, read_hf_config
from jackfield.models.layers import pack_cpu_linears
from jackfield.plugins import get_registry
from jackfield.specs import resolve_factory


def model_class(architecture: str) -> type[ModelFamily]:
    """The registered class for an HF architecture name (a miss lists what is registered)."""
    entry = get_registry().lookup("model", architecture)
    cls = resolve_factory(entry.spec.factory)
    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)):
        raise TypeError(f"model {architecture!r}: factory {entry.spec.factory!r} of {entry.distribution} "
                        "is not a subclass of jackfield.contracts.model.ModelFamily")
    return cls


def load_model(model_dir: str | Path, backends: AttentionBackends, dtype: torch.dtype,
               device: torch.device | str, kv_cache_dtype: KVCacheDType = "auto") -> ModelFamily:
    """Build the registered family for `model_dir`'s architecture and load its weights (its
    `Linear` layers then pack CPU float32 weights for oneDNN: models/layers.py)."""
    hf_config = read_hf_config(model_dir)
    try:
        cls = model_class(architecture_of(hf_config))
    except (KeyError, ValueError) as exc:  # a miss in the registry, or not exactly one architecture
        raise ModelFileError(f"{Path(model_dir) / 'config.json'}: architectures: {exc.args[0]}") from None
    model = cls.from_pretrained(model_dir, hf_config, backends, dtype, device, kv_cache_dtype)
    pack_cpu_linears(model)
    return model
