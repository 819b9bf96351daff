"""A broken plugin fails alone: it is listed as failed with its reason, every other plugin loads,
and `jackfield plugins` (text and --json) and backend selection keep working."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from jackfield.cli import main
from jackfield.contracts.attention import AttentionRequirements
from jackfield.plugins import get_registry
from jackfield.selection import SelectionError, select_attention_backend

HEADER = """
import sys
import jackfield
from jackfield.builtins import TORCH_REF_CAPABILITIES
from jackfield.specs import AttentionBackendSpec, ModelSpec, SamplerSpec
JACKFIELD_API = ">=1.0,<2"
"""

GOOD = HEADER + """
@jackfield.hookimpl
def register_samplers():
    return [SamplerSpec(name="good_sampler", factory="jackfield.sampling.samplers:TorchRefSampler")]
"""

BROKEN = {
    "non_record": ("""
        @jackfield.hookimpl
        def register_samplers():
            return [{"name": "dict_sampler"}]
        """, "register_samplers returned {'name': 'dict_sampler'}, not a SamplerSpec"),
    "wrong_kind": ("""
        @jackfield.hookimpl
        def register_samplers():
            return [ModelSpec(name="NotASampler", factory="x:y")]
        """, "not a SamplerSpec"),
    "not_iterable": ("""
        @jackfield.hookimpl
        def register_samplers():
            return 42
        """, "register_samplers returned 42, not a list of SamplerSpec"),
    "a_string": ("""
        @jackfield.hookimpl
        def register_samplers():
            return "murmur3"
        """, "not a list of SamplerSpec"),
    "non_string_name": ("""
        @jackfield.hookimpl
        def register_samplers():
            return [SamplerSpec(name=7, factory="x:y")]
        """, "SamplerSpec: name must be a non-empty string, got 7"),
    "non_numeric_priority": ("""
        @jackfield.hookimpl
        def register_attention_backends():
            return [AttentionBackendSpec(name="bad_prio", factory="x:y", capabilities=TORCH_REF_CAPABILITIES,
                                         priority="high")]
        """, "priority must be a finite number, got 'high'"),
    "wrong_signature": ("""
        @jackfield.hookimpl
        def register_samplers(config):
            return []
        """, "register_samplers"),
    "exit_at_import": ("""
        sys.exit("plugin says goodbye")
        """, "SystemExit: plugin says goodbye"),
    "exit_in_hook": ("""
        @jackfield.hookimpl
        def register_models():
            sys.exit(3)
        """, "SystemExit: 3"),
    "unknown_hook": ("""
        @jackfield.hookimpl
        def register_sampler():
            return [SamplerSpec(name="typo_sampler", factory="x:y")]
        """, "hookimpl 'register_sampler' matches no hookspec (did you mean 'register_samplers'?)"),
}


def listing(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """`jackfield plugins` then `jackfield plugins --json`, both exit 0; the JSON."""
    assert main(["plugins"]) == 0
    assert main(["plugins", "--json"]) == 0
    text = capsys.readouterr().out
    return json.loads(text[text.index("\n{") + 1:])


def plugin_row(data: dict[str, object], name: str) -> dict[str, object]:
    return next(p for p in data["plugins"] if p["name"] == name)  # type: ignore[attr-defined,index]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_plugin_fails_alone(make_dist, capsys: pytest.CaptureFixture[str], case: str) -> None:  # type: ignore[no-untyped-def]
    source, reason = BROKEN[case]
    make_dist("bad-dist", "bad_plugin", HEADER + textwrap.dedent(source))
    make_dist("good-dist", "good_plugin", GOOD)
    data = listing(capsys)
    bad = plugin_row(data, "bad_plugin")
    assert bad["status"] == "failed" and bad["distribution"] == "bad-dist"
    assert reason in bad["reason"], bad["reason"]
    assert bad["registers"] == []
    assert plugin_row(data, "good_plugin")["status"] == "active"
    samplers = {s["name"] for s in data["samplers"]}  # type: ignore[attr-defined,index]
    assert "good_sampler" in samplers and {"dict_sampler", "typo_sampler"}.isdisjoint(samplers)
    assert plugin_row(data, "builtins")["status"] == "active"


def test_entry_points_line_without_equals(make_dist, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    site = make_dist("bad-dist", "bad_plugin", GOOD.replace("good_sampler", "bad_sampler"))
    make_dist("good-dist", "good_plugin", GOOD)
    (site / "bad_dist-1.0.dist-info" / "entry_points.txt").write_text(
        "[console_scripts]\ntool = x:y\n\n[jackfield]\nbad_plugin\nsecond = bad_plugin\n")
    data = listing(capsys)
    bad = plugin_row(data, "bad_plugin")
    assert bad["status"] == "failed" and bad["distribution"] == "bad-dist"
    assert "entry_points.txt line 5 'bad_plugin' is not 'name = module'" in bad["reason"]
    assert plugin_row(data, "second")["status"] == "active"  # the same file's well-formed line loads
    assert plugin_row(data, "good_plugin")["status"] == "active"


@pytest.mark.parametrize("metadata", ["Metadata-Version: 2.1\nVersion: 1.0\n", None],
                         ids=["no_name", "no_file"])
def test_metadata_without_a_name(make_dist, capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
                                 metadata: str | None) -> None:
    site = make_dist("bad-dist", "bad_plugin", GOOD.replace("good_sampler", "bad_sampler"))
    make_dist("good-dist", "good_plugin", GOOD)
    if metadata is None:
        (site / "bad_dist-1.0.dist-info" / "METADATA").unlink()
    else:
        (site / "bad_dist-1.0.dist-info" / "METADATA").write_text(metadata)
    data = listing(capsys)
    bad = next(p for p in data["plugins"] if p["distribution"] == "<no name>")  # type: ignore[attr-defined,index]
    assert bad["status"] == "failed" and "METADATA has no Name" in bad["reason"]
    assert "bad_dist-1.0.dist-info" in bad["reason"]
    assert plugin_row(data, "good_plugin")["status"] == "active"
    assert "bad_sampler" not in {s["name"] for s in data["samplers"]}  # type: ignore[attr-defined,index]


BACKENDS = HEADER + """
from jackfield.attention.torch_ref import TorchRefBackend

def raising_probe():
    raise RuntimeError("probe exploded")

def exiting_probe():
    sys.exit("probe exits")

class RaisingValidate(TorchRefBackend):
    name = "raising_validate"

    @classmethod
    def validate(cls, req):
        raise RuntimeError("validate exploded")

@jackfield.hookimpl
def register_attention_backends():
    def make(name, factory="jackfield.attention.torch_ref:TorchRefBackend", **kw):
        return AttentionBackendSpec(name=name, factory=factory, capabilities=TORCH_REF_CAPABILITIES, **kw)
    return [make("raising_probe", availability=raising_probe, priority=1000),
            make("exiting_probe", availability=exiting_probe, priority=1000),
            make("odd_probe", availability=lambda: "yes", priority=1000),
            make("raising_validate", factory="probe_plugin:RaisingValidate", priority=1000)]
"""

MLA = AttentionRequirements(kind="mla", dtype=torch.float32, head_size=576, block_size=16, device="cpu")


def test_probes_and_validate_that_raise_make_a_backend_unavailable(
        make_dist, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    make_dist("probe-dist", "probe_plugin", BACKENDS)
    data = listing(capsys)
    rows = {b["name"]: b for b in data["attention_backends"]}  # type: ignore[attr-defined,index]
    assert rows["raising_probe"]["available"] is False
    assert "availability probe raised RuntimeError: probe exploded" in rows["raising_probe"]["reason"]
    assert "availability probe raised SystemExit: probe exits" in rows["exiting_probe"]["reason"]
    assert "returned 'yes', not an Availability" in rows["odd_probe"]["reason"]
    assert rows["torch_ref"]["available"] is True

    choice = select_attention_backend(MLA, "auto", registry=get_registry())
    # every one of the broken plugin's higher-priority backends is rejected with its reason; another serves
    assert get_registry().lookup("attention", choice.name).distribution != "probe-dist"
    assert "validate() raised RuntimeError: validate exploded" in choice.rejected["raising_validate"]
    with pytest.raises(SelectionError, match="probe exploded"):
        select_attention_backend(MLA, "raising_probe", registry=get_registry())


def test_doctor_and_a_listing_survive_every_broken_plugin_at_once(
        make_dist, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    for index, case in enumerate(sorted(BROKEN)):
        make_dist(f"bad-{index}", f"bad_plugin_{index}", HEADER + textwrap.dedent(BROKEN[case][0]))
    make_dist("probe-dist", "probe_plugin", BACKENDS)
    make_dist("good-dist", "good_plugin", GOOD)
    data = listing(capsys)
    statuses = {p["name"]: p["status"] for p in data["plugins"]}  # type: ignore[attr-defined,index]
    assert [statuses[f"bad_plugin_{i}"] for i in range(len(BROKEN))] == ["failed"] * len(BROKEN)
    assert statuses["good_plugin"] == statuses["probe_plugin"] == "active"
    assert main(["doctor", "--config", str(_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "OK" in out
    assert "rejected raising_validate: validate() raised RuntimeError: validate exploded" in out


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "jackfield.toml"
    path.write_text('[sampler]\nname = "good_sampler"\n')
    return path
