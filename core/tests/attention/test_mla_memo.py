"""The MLA base memoizes per-step plans (the expanded prefill's gather plan and visibility mask)
in metadata.extra, which `replace`d copies share: a plan is reused only for the very tensors and
values it was built from."""

from __future__ import annotations

import torch
from jackfield.attention.mla import _memo
from jackfield.testing.problems import make_batch


def test_memo_hits_only_for_the_same_tensors_and_values() -> None:
    md = make_batch([1, 4], [6, 9], 1, 4, "cpu", torch.Generator().manual_seed(0)).metadata
    calls: list[str] = []

    def build(tag: str):  # noqa: ANN202
        return lambda: calls.append(tag) or tag

    assert _memo(md, "plan", build("a")) == "a"
    assert _memo(md, "plan", build("b")) == "a"  # same step, same tensors: built once
    assert _memo(md.replace(causal=False), "plan", build("c")) == "c"  # shares extra, other value
    assert _memo(md.replace(seq_lens=md.seq_lens.clone()), "plan", build("d")) == "d"  # other tensor
    md.seq_lens.add_(0)  # modified in place: its version moves on
    assert _memo(md, "plan", build("e")) == "e"
    with torch.inference_mode():
        frozen = md.replace(seq_lens=md.seq_lens.clone())
    assert _memo(frozen, "plan", build("f")) == "f"
    assert _memo(frozen, "plan", build("g")) == "g"  # no version counter: never reused
    assert calls == ["a", "c", "d", "e", "f", "g"]
