"""Fixtures for core tests: throwaway installed distributions with real entry points, and a
copy of the embedded default model to break."""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from jackfield.models.default_model import default_model_dir
from jackfield.plugins import reset_registry

MakeDist = Callable[..., Path]


@pytest.fixture
def make_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeDist]:
    """Write `module_name.py` and a dist-info with an entry point in group "jackfield" onto
    sys.path, exactly as `pip install` leaves a distribution, so discovery is the real one."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def make(dist_name: str, module_name: str, source: str, ep_name: str | None = None,
             version: str = "1.0") -> Path:
        modules.append(module_name)
        sys.modules.pop(module_name, None)  # an earlier test's module of the same name
        (site / f"{module_name}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist_name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[jackfield]\n{ep_name or module_name} = {module_name}\n")
        return site

    reset_registry()
    yield make
    reset_registry()
    for name in modules:
        sys.modules.pop(name, None)


# The reference kernels registered a second time, under their own class and name.
SECOND_REF = """
import jackfield
from jackfield.attention.torch_ref import TorchRefBackend
from jackfield.builtins import TORCH_REF_CAPABILITIES
from jackfield.specs import AttentionBackendSpec

JACKFIELD_API = ">=1.0,<2"


class SecondRef(TorchRefBackend):
    name = "second_ref"


@jackfield.hookimpl
def register_attention_backends():
    return [AttentionBackendSpec(name="second_ref", factory="second_ref_plugin:SecondRef",
                                 capabilities=TORCH_REF_CAPABILITIES)]
"""


@pytest.fixture
def second_ref(make_dist: MakeDist) -> str:
    """Installs a backend "second_ref" (torch_ref's kernels, its own class), so the prefill and
    decode roles can name different backends; returns its name."""
    make_dist("jackfield-second-ref", "second_ref_plugin", SECOND_REF)
    return "second_ref"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A copy of the embedded default model (config, tokenizer, safetensors) to break."""
    directory = tmp_path / "model"
    shutil.copytree(default_model_dir(), directory)
    return directory
