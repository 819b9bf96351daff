"""Slot mappings the engine builds on the host are range-checked there: the kernels' own check
(`check_slot_range_once`, `check_slot_mapping`), which reads the device tensor back (a device
sync on a GPU), then finds the mapping already checked. An eager step (prefill, decode, a
drafter's rows) then waits for the device only at its token read-back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.attention import checks
from jackfield.testing.checkpoints import write_granite


def test_a_host_checked_mapping_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    host = torch.tensor([3, -1, 17, 5])
    device_copy = host.clone()  # what the engine hands the kernels
    checks.check_slots_on_host(device_copy, host, capacity=4 * 8)
    read: list[torch.Tensor] = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: read.append(t) or real(t))
    checks.check_slot_range_once(device_copy, 4, 8)  # remembered: nothing read
    assert checks.check_slot_mapping(device_copy, 4, 4 * 8) is True  # padding (-1), remembered
    assert read == []
    other = host.clone()
    checks.check_slot_range_once(other, 4, 8)  # a mapping nobody checked is read
    assert len(read) == 1
    with pytest.raises(ValueError, match="slot 32 is out of range: the cache has 32 slots"):
        checks.check_slots_on_host(host.clone(), torch.tensor([0, 32]), capacity=32)
    read.clear()
    device_copy.add_(0)  # written since: its range is read again
    checks.check_slot_range_once(device_copy, 4, 8)
    assert read == [device_copy]


def test_eager_steps_read_no_slot_mapping_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_granite("llama", tmp_path / "llama")
    llm = LLM(str(tmp_path / "llama"), **{"engine.device": "cpu", "attention.backend": "torch_ref",
                                          "model.dtype": "float32"})
    host_checks, reads = [], []
    real_check, real_aminmax = checks.check_slots_on_host, torch.aminmax

    def counted_check(slot_mapping: torch.Tensor, host_slots: torch.Tensor, capacity: int) -> None:
        host_checks.append(capacity)
        real_check(slot_mapping, host_slots, capacity)

    monkeypatch.setattr("jackfield.engine.model_runner.check_slots_on_host", counted_check)
    monkeypatch.setattr(torch, "aminmax", lambda t: reads.append(t.shape) or real_aminmax(t))
    llm.generate([[1, 2, 3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert host_checks  # every eager step built its slots on the host ...
    assert len(reads) == len(host_checks)  # ... and only that check read them (4 layers each)
