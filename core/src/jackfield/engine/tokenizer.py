"""The model directory's tokenizer, when it has one (a directory without one takes token ids)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
