"""KV cache groups: layers that attend alike share one block table per request.

A model whose layers all attend alike (all full, or all one window) is one group and every
layer gets its own cache tensor, as before. A hybrid model (full layers beside sliding-window
layers) gets one group per attention pattern, so a window group's table can drop blocks that
left the window while the full group keeps them all. As in vLLM's hybrid KV cache manager, the
groups draw block ids from one shared pool and have equal sizes S (a pattern with more layers is
split into several groups of at most S layers): the model holds S cache tensors, and tensor j
serves the j-th layer of every group. A block id then names S layer-blocks of memory, all owned
by the one group whose table holds it, so no group pays for another's blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from jackfield.contracts.attention import AttentionLayerSpec


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its sliding window (None: full attention)
    layer_group: tuple[int, ...]  # per layer: the group whose block tables it reads
    layer_tensor: tuple[int, ...]  # per layer: the cache tensor it uses
    num_tensors: int

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1


def plan_kv_cache_groups(layers: Sequence[AttentionLayerSpec]) -> KVCacheGroups:
    """Groups by sliding window, full attention first (group 0), each pattern in layer order."""
    if not layers:
        raise ValueError("a model needs at least one KV cache layer")
    windows = sorted({layer.sliding_window for layer in layers}, key=lambda w: (w is not None, w or 0))
    if len(windows) == 1:
        n = len(layers)
        return KVCacheGroups((windows[0],), (0,) * n, tuple(range(n)), n)
    # Shared tensors need every layer's cache to have one layout.
    layouts = {dataclasses.replace(layer, sliding_window=None) for layer in layers}
    if len(layouts) > 1:
        raise ValueError(f"sliding-window and full layers must share one KV cache layout, got "
                         f"{len(layouts)}: " + "; ".join(sorted(map(str, layouts))))
    by_window = {w: [i for i, layer in enumerate(layers) if layer.sliding_window == w] for w in windows}
    size = min(len(indices) for indices in by_window.values())
    group_windows: list[int | None] = []
    layer_group = [0] * len(layers)
    layer_tensor = [0] * len(layers)
    for window, indices in by_window.items():
        for start in range(0, len(indices), size):
            for slot, layer in enumerate(indices[start : start + size]):
                layer_group[layer], layer_tensor[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_tensor), size)
