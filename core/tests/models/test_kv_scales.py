"""Reading fp8 KV-cache scales from a checkpoint and choosing a run's scales (models/kv_scales.py):
the names vLLM reads, and every way a checkpoint's scales cannot be used, refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from jackfield.models.kv_scales import is_kv_scale_tensor, plan_kv_scales, read_checkpoint_kv_scales
from safetensors.torch import save_file

LAYERS = 3


def write(directory: Path, tensors: dict[str, torch.Tensor]) -> list[Path]:
    """One safetensors file holding `tensors` and an ordinary weight beside them."""
    path = directory / "model.safetensors"
    save_file({**tensors, "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 4)}, str(path))
    return [path]


def scales(count: int) -> list[float]:
    return [random.uniform(1e-3, 1.0) for _ in range(count)]


@pytest.mark.parametrize("form", ["self_attn.{}_scale", "self_attn.{}_proj.{}_scale"],
                         ids=["compressed-tensors", "modelopt"])
def test_key_and_value_scales_of_an_mha_checkpoint(tmp_path: Path, form: str) -> None:
    keys, values = scales(LAYERS), scales(LAYERS)
    tensors = {}
    for i in range(LAYERS):
        for kind, value in (("k", keys[i]), ("v", values[i])):
            tensors[f"model.layers.{i}." + form.format(kind, kind)] = torch.tensor(value)
    found = read_checkpoint_kv_scales(write(tmp_path, tensors), LAYERS, mla=False)
    assert not found.problems
    assert found.layers == {i: (torch.tensor(keys[i]).item(), torch.tensor(values[i]).item())
                            for i in range(LAYERS)}
    plan, problems = plan_kv_scales("auto", found, LAYERS, mla=False)
    assert not problems and plan is not None and plan.source == "checkpoint"
    assert plan.layers == tuple(found.layers[i] for i in range(LAYERS))


def test_the_older_kv_scale_serves_keys_and_values_and_an_mla_record(tmp_path: Path) -> None:
    shared = scales(LAYERS)
    files = write(tmp_path, {f"model.layers.{i}.self_attn.kv_scale": torch.tensor([shared[i]])
                             for i in range(LAYERS)})
    stored = [torch.tensor(s).item() for s in shared]  # float32, as written
    mha, mla = (read_checkpoint_kv_scales(files, LAYERS, mla).layers for mla in (False, True))
    assert mha == {i: (s, s) for i, s in enumerate(stored)} and mla == {i: (s,) for i, s in enumerate(stored)}


def test_an_mla_record_takes_k_scale_and_skips_the_rest(tmp_path: Path) -> None:
    """v_scale beside k_scale is not the record's (vLLM's reading); q_scale and prob_scale are fp8
    attention arithmetic; layers past num_hidden_layers (DeepSeek's MTP) are not run."""
    keys = scales(LAYERS)
    tensors = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(keys[i]) for i in range(LAYERS)}
    tensors |= {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(-1.0)
                for i in range(LAYERS) for kind in ("v", "q", "prob")}
    tensors[f"model.layers.{LAYERS}.self_attn.k_scale"] = torch.tensor(float("nan"))  # an MTP layer
    found = read_checkpoint_kv_scales(write(tmp_path, tensors), LAYERS, mla=True)
    assert not found.problems
    assert found.layers == {i: (torch.tensor(k).item(),) for i, k in enumerate(keys)}
    assert all(is_kv_scale_tensor(name) for name in tensors)
    assert not is_kv_scale_tensor("model.layers.0.self_attn.k_proj.weight")


@pytest.mark.parametrize(
    "tensors, mla, fragment",
    [
        ({"model.layers.0.self_attn.k_scale": torch.full((4,), 0.1)}, True,
         "model.layers.0.self_attn.k_scale has shape [4]: per-head or per-channel"),
        ({"model.layers.1.self_attn.k_scale": torch.tensor(-0.5)}, True,
         "model.layers.1.self_attn.k_scale = -0.5: a KV scale must be a finite number > 0"),
        ({"model.layers.2.self_attn.k_scale": torch.tensor(float("inf"))}, True, "finite number > 0"),
        ({"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.1)}, False,
         "model.layers.0.self_attn.k_proj.k_scale has no partner: an MHA layer needs k_scale and v_scale"),
        ({"model.layers.0.self_attn.v_scale": torch.tensor(0.1)}, True,
         "an MLA layer needs k_scale or kv_scale"),
    ],
    ids=["per-head", "negative", "infinite", "unpaired", "mla-v-only"],
)
def test_unusable_scales_are_refused_by_name(tmp_path: Path, tensors: dict[str, torch.Tensor], mla: bool,
                                            fragment: str) -> None:
    named = {int(name.split(".")[2]) for name in tensors}  # the other layers get good scales
    complete = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.25)
                for i in range(LAYERS) if i not in named}
    found = read_checkpoint_kv_scales(write(tmp_path, {**complete, **tensors}), LAYERS, mla)
    assert any(fragment in p for p in found.problems), found.problems
    for choice in ("auto", "checkpoint"):
        plan, problems = plan_kv_scales(choice, found, LAYERS, mla)
        assert plan is None and any(fragment in p for p in problems)
        assert all('"calibrate" or a number ignores them' in p for p in problems)
    for choice in ("calibrate", 0.5):  # the checkpoint's scales are not used: nothing to refuse
        plan, problems = plan_kv_scales(choice, found, LAYERS, mla)
        assert plan is not None and not problems


def test_scales_for_some_layers_only(tmp_path: Path) -> None:
    files = write(tmp_path, {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.1) for i in (0, 2)})
    found = read_checkpoint_kv_scales(files, LAYERS, mla=True)
    assert found.problems == ("the checkpoint has KV scales for layers [0, 2] but not for [1]",)


def test_the_plan_without_checkpoint_scales(tmp_path: Path) -> None:
    found = read_checkpoint_kv_scales(write(tmp_path, {}), LAYERS, mla=False)
    assert not found.layers and not found.problems
    plan, problems = plan_kv_scales("auto", found, LAYERS, mla=False)
    assert plan is not None and plan.source == "calibration" and plan.layers is None and not problems
    plan, problems = plan_kv_scales("checkpoint", found, LAYERS, mla=False)
    assert plan is None and "the checkpoint has no KV scales" in problems[0]
    value = random.uniform(1e-3, 1.0)
    plan, problems = plan_kv_scales(value, found, LAYERS, mla=False)
    assert plan is not None and plan.source == "config" and plan.layers == ((value, value),) * LAYERS
    plan, _ = plan_kv_scales(value, found, LAYERS, mla=True)
    assert plan is not None and plan.layers == ((value,),) * LAYERS
