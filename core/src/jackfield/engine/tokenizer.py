"""The model directory's tokenizer, when it has one (a directory without one takes token ids)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from jackfield.model_files import TOKENIZER_FILES, ModelFileError, read_json_object, refuse_model_code


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer (never its code: `auto_map` is refused, remote code is not trusted)."""
    directory = Path(model_dir)
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not present:
        return None
    refuse_model_code(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            read_json_object(directory / name)  # malformed JSON is named here, not deep in `tokenizers`
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    # The tokenizers library raises plain Exception for content it cannot parse: the files are the
    # user's input here, so any failure to build from them is reported against them.
    except Exception as exc:
        raise ModelFileError(f"{directory}: the tokenizer files ({', '.join(present)}) cannot be loaded: "
                             f"{type(exc).__name__}: {exc}") from exc
