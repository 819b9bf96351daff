"""The model directory's tokenizer, when it has one (a directory without one takes token ids)."""

from __future__ import annotations

from collections.abc import Mapping
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


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase | None, model_dir: str | Path,
                    messages: object) -> list[int]:
    """A conversation ([{role, content}, ...]) rendered by the model's chat template, with the
    assistant's turn opened; every problem a ValueError that names it."""
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages)):
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError(f"{model_dir} has no chat template (tokenizer_config.json chat_template): "
                         "give prompts instead of messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own error (a role it does not know, ...): user input
        raise ValueError(f"the chat template cannot render these messages: {exc}") from None
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
