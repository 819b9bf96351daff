"""TOML config: defaults, overrides, and every problem reported with file, key and suggestion."""

from __future__ import annotations

from pathlib import Path

import pytest
from jackfield.config import ConfigError, JackfieldConfig, load_config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "jackfield.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_dataclass_defaults() -> None:
    assert load_config() == JackfieldConfig()


def test_file_values_and_cli_overrides_win(tmp_path: Path) -> None:
    path = write(tmp_path,
                 '[engine]\nblock_size = 64\nmax_num_seqs = 8\n[attention]\nbackend = "torch_ref"\n')
    config = load_config(path, {"engine.max_num_seqs": 3, "sampler.seed": 7})
    assert config.engine.block_size == 64
    assert config.engine.max_num_seqs == 3
    assert config.attention.backend == "torch_ref"
    assert config.sampler.seed == 7


def test_ints_are_accepted_for_floats(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[engine]\ncpu_kv_cache_gib = 2\n"))
    assert config.engine.cpu_kv_cache_gib == 2.0 and isinstance(config.engine.cpu_kv_cache_gib, float)


def test_every_problem_is_listed_with_file_key_and_suggestion(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[engin]\nx = 1\n[engine]\nblok_size = 3\nmax_num_seqs = "many"\nenable_prefix_caching = 1\n'
        '[model]\ndtype = "fp32"\n',
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    assert len(problems) == 5
    assert all(p.startswith(str(path)) for p in problems)
    text = "\n".join(problems)
    assert "unknown section [engin] (did you mean 'engine'?)" in text
    assert "unknown key engine.blok_size (did you mean 'block_size'?)" in text
    assert "engine.max_num_seqs must be an integer, got 'many'" in text
    assert "engine.enable_prefix_caching must be a boolean, got 1" in text
    assert "model.dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got 'fp32'" in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[engine]\nblock_size = 0\n", "engine.block_size must be > 0"),
        ("[engine]\ngpu_memory_fraction = 1.5\n", "gpu_memory_fraction must be in (0, 1]"),
        ('[speculative]\nmethod = "ngram"\n', "num_speculative_tokens must be > 0"),
        ("[parallel]\ndcp_size = 0\n", "parallel.dcp_size must be >= 1"),
        ("[parallel]\ntensor_parallel_size = 0\n", "parallel.tensor_parallel_size must be >= 1"),
        ("[parallel]\ntensor_parallel_size = 4\ndcp_size = 3\n",
         "parallel.dcp_size 3 must divide parallel.tensor_parallel_size 4"),
        ("[parallel]\ndcp_interleave = 3\n[engine]\nblock_size = 16\n",
         "parallel.dcp_interleave 3 must divide engine.block_size 16"),
        ("[engine\n", "not valid TOML"),
        ("engine = 3\n", "[engine] must be a table"),
    ],
)
def test_range_and_syntax_errors(tmp_path: Path, text: str, message: str) -> None:
    pattern = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, text))


def test_missing_file_and_bad_override() -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("/nonexistent/jackfield.toml")
    with pytest.raises(ConfigError, match="section.key"):
        load_config(None, {"block_size": 3})
    with pytest.raises(ConfigError, match="unknown key engine.nope"):
        load_config(None, {"engine.nope": 3})


def test_config_is_frozen() -> None:
    config = load_config()
    with pytest.raises(AttributeError):
        config.engine.block_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_example_files_parse(example: Path) -> None:
    """Every value written in an example file is the value the config carries."""
    import tomllib

    config = load_config(example)
    written = tomllib.loads(example.read_text())
    assert written
    for section, table in written.items():
        for key, value in table.items():
            assert getattr(getattr(config, section), key) == value, f"{section}.{key}"


def test_every_key_is_documented() -> None:
    import dataclasses
    import typing

    doc = (REPO / "docs/configuration.md").read_text()
    for section in dataclasses.fields(JackfieldConfig):
        assert f"[{section.name}]" in doc, section.name
        cls = typing.get_type_hints(JackfieldConfig)[section.name]
        for key in dataclasses.fields(cls):
            assert f"`{key.name}`" in doc, f"{section.name}.{key.name} is not in docs/configuration.md"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[engine]\ndevice = "tpu"\n', "engine.device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ('[attention]\ndrafter_backend = "torch_ref"\n',
         "drafter_backend is set but speculative.method is not"),
        ("[kv_connector.options]\nhost = 1\n", "kv_connector.options is set but kv_connector.name is not"),
    ],
)
def test_settings_that_would_be_ignored_are_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(write(tmp_path, text))


def test_type_and_range_problems_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, '[engine]\nblock_size = "x"\nmax_num_seqs = -1\n'))
    text = "\n".join(info.value.problems)
    assert "engine.block_size must be an integer" in text and "engine.max_num_seqs must be > 0" in text
