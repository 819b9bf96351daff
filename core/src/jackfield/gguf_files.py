"""GGUF checkpoints (llama.cpp's single-file format): converted once into a folder the engine
loads like any Hugging Face checkpoint.

transformers' GGUF reader (the `gguf` package: parsing only, no code from the file) dequantizes
the weights to float32 and rebuilds the config and tokenizer (chat template included); the folder
gets config.json, model.safetensors and the tokenizer files, cached under the cache dir by the
file's path, size and modification time, so a changed file converts again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from jackfield.model_files import ModelFileError

GGUF_SUFFIX = ".gguf"


def cache_dir() -> Path:
    """Where Jackfield keeps what it generates or converts (~/.cache/jackfield, $JACKFIELD_CACHE)."""
    return Path(os.environ.get("JACKFIELD_CACHE") or Path.home() / ".cache" / "jackfield")


def gguf_source(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one *.gguf of a folder without a
    config.json (None: `path` is an ordinary checkpoint folder, or nothing)."""
    p = Path(path)
    if p.is_file() and p.suffix == GGUF_SUFFIX:
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*" + GGUF_SUFFIX))
        if len(found) > 1:
            raise ModelFileError(
                f"{p}: several GGUF files ({', '.join(f.name for f in found)}): name one file as the model"
            )
        return found[0] if found else None
    return None


def checkpoint_dir(path: str | Path) -> Path:
    """The folder to load for a model path: the path itself, or its GGUF file converted."""
    gguf = gguf_source(path)
    return Path(path) if gguf is None else checkpoint_from_gguf(gguf)


def checkpoint_from_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    identity = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    target = cache_dir() / "gguf" / f"{gguf.stem}-{hashlib.sha256(identity).hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _convert(gguf, staging)
        staging.rename(target)  # atomic: a folder with config.json is always complete
    except FileExistsError:  # another process converted it first
        shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            local_files_only=True,
            trust_remote_code=False,
        )
    except ImportError as exc:
        raise ModelFileError(
            f"{gguf}: reading GGUF needs the gguf and accelerate packages "
            f"(pip install 'jackfield[gguf]'): {exc}"
        ) from None
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ModelFileError(
            f"{gguf}: transformers cannot read this GGUF file: {type(exc).__name__}: {exc}"
        ) from None
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dequantized floats now
    config["architectures"] = [type(model).__name__]  # GGUF metadata does not carry it
    type(model.config).from_dict(config).save_pretrained(out)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one copy of the tied embedding, under its own name
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True, trust_remote_code=False
        )
    except Exception:  # a GGUF without tokenizer metadata: the model takes token-id prompts
        return
    tokenizer.save_pretrained(out)
