"""The model-family contract: what the engine may ask of a model, as code.

A family is a subclass of `ModelFamily` registered through `register_models` under the Hugging
Face `architectures` name it serves. The engine reads only what is declared here: the frozen
`ModelCapabilities` record, the KV cache layers, and the forward made of five pieces around the
attention calls:

    x = embed(input_ids)
    for i in range(num_layers):
        inputs = before_attention(i, x, positions)      # the layer's attention inputs (q, k, v, ...)
        out = attend(i, step, inputs)                   # the backend's part: writes KV, attends
        x = after_attention(i, x, out, rows)            # output projection, residual, MLP
    hidden = final_norm(x)

`forward` is that loop and nothing else, which is why the engine may replay everything but
`attend` from CUDA graphs (engine/piecewise_graphs.py) and why hidden states at chosen layer
inputs (EAGLE-3's taps) come from any family without its help. A family never overrides it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.recurrent import RecurrentStateSpec

if TYPE_CHECKING:  # transformers is imported by the families that need it, not by the contract
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelCapabilities:
    """What a loaded model is, as data (read by the engine, `jackfield doctor` and drafters)."""

    vocab_size: int
    hidden_size: int
    num_layers: int  # decoder layers: `attend` is called once per layer, taps index these
    max_model_len: int  # positions the model was trained for (max_position_embeddings)
    dtype: torch.dtype  # the activation dtype
    causal: bool = True  # False: a bidirectional (embedding) model, every prompt runs whole, no decode
    # The pieces other than `attend` never sync the host nor take data-dependent shapes on this
    # device, so the engine may record them in CUDA graphs (e.g. MoE experts as grouped matmuls);
    # nor does the family's own work inside `attend` in decode steps (V3.2's indexer), which decode
    # graphs record whole.
    cuda_graph_safe: bool = False
    num_mtp_layers: int = 0  # multi-token-prediction layers stored in the checkpoint (DeepSeek's MTP)
    # The family splits itself over the tensor-parallel ranks (jackfield.distributed) when built
    # under parallel.tensor_parallel_size > 1; the engine refuses that size for the others.
    tensor_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelCapabilities.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_mtp_layers < 0:
            raise ValueError(f"ModelCapabilities.num_mtp_layers must be >= 0, got {self.num_mtp_layers}")

    @property
    def eagle3_tap_layers(self) -> tuple[int, ...]:
        """The layers whose inputs EAGLE-3 drafts from by default: early, middle and late."""
        return eagle3_tap_layers(self.num_layers)


def eagle3_tap_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps of a target with `num_layers` layers: the inputs of layers 2, L // 2
    and L - 3 (the published recipe), fewer when a small model makes them coincide."""
    n = num_layers
    return tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)}))


class LayerTaps:
    """Hidden states at chosen layer inputs, collected during one forward (EAGLE-3's taps):
    `states[j]` is the input of layer `layers[j]` ([T, hidden] over every row of the step)."""

    def __init__(self, layers: tuple[int, ...], num_layers: int) -> None:
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(f"tap layers {list(layers)} must be distinct layers in [0, {num_layers})")
        self.layers = layers
        self.states: list[torch.Tensor | None] = [None] * len(layers)

    def offer(self, layer: int, x: torch.Tensor) -> None:
        if layer in self.layers:
            self.states[self.layers.index(layer)] = x


class LayerHooks(ABC):
    """Called around each decoder layer's `attend` (a KV connector waits for a layer's loads
    before it reads its cache and saves what it wrote after)."""

    @abstractmethod
    def before_attend(self, layer: int) -> None: ...

    @abstractmethod
    def after_attend(self, layer: int) -> None: ...


class ModelFamily(nn.Module, ABC):
    """A model family: built from a transformers config, loaded from a local checkpoint."""

    @classmethod
    @abstractmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: PretrainedConfig, backends: AttentionBackends,
                        dtype: torch.dtype, device: torch.device | str,
                        kv_cache_dtype: KVCacheDType = "auto") -> ModelFamily:
        """The family built on `device` with its weights loaded (and handed to the attention
        impls' process_weights_after_loading), in eval mode."""

    @property
    @abstractmethod
    def capabilities(self) -> ModelCapabilities: ...

    @property
    @abstractmethod
    def kv_cache_layers(self) -> list[AttentionLayerSpec]:
        """One spec per KV cache the model writes, in the order of `step.kv_caches` (the engine
        groups equal layouts by sliding window into KV cache groups and allocates them). Cache j
        is read and written by decoder layer j % num_layers (one cache per layer, or several
        rounds of them: DeepSeek-V3.2's latent caches, then its indexer-key caches)."""

    @property
    def recurrent_state_layers(self) -> list[RecurrentStateSpec]:
        """A hybrid model's recurrent layers (Gated DeltaNet, Mamba2), in layer order: the state
        each keeps per request (the engine's slot pool, `step.recurrent`). Such a model lists
        one KV cache per attention layer, in layer order, in `kv_cache_layers` (not one per
        decoder layer); the engine runs it without KV connectors, fp8 caches, MTP layers, the
        prefix cache or prefill CUDA graphs (decode steps are replayed). Empty for a model of
        attention layers only."""
        return []

    @property
    @abstractmethod
    def attention_output_shape(self) -> tuple[int, ...]:
        """The shape of one row of `attend`'s output (e.g. [heads, v_head_dim])."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input x [T, hidden]."""

    @abstractmethod
    def before_attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer i's attention inputs from its input x (every tensor has T rows)."""

    @abstractmethod
    def attend(self, i: int, step: StepContext, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Layer i's attention over the paged cache: writes the KV of every row, returns [T, ...]
        of `attention_output_shape`. The only piece that reads the step context."""

    @abstractmethod
    def after_attention(self, i: int, x: torch.Tensor, attn_out: torch.Tensor,
                        output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's output for `output_rows` of x (all rows when None)."""

    @abstractmethod
    def final_norm(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, hidden] -> float32 logits [N, vocab_size]."""

    # Multi-token prediction (DeepSeek's MTP layers, stored after the main ones). Loaded only
    # when a drafter runs them; a family whose checkpoints have none keeps these defaults.

    def load_mtp_layers(self, model_dir: str | Path) -> None:
        """Build and load the checkpoint's `capabilities.num_mtp_layers` MTP layers after
        `from_pretrained`: from then on `kv_cache_layers` lists their caches after the model's
        own, and `mtp_forward` / `mtp_logits` run them. A ValueError says why it cannot."""
        raise ValueError(f"{type(self).__name__} has no multi-token-prediction layers to load")

    def mtp_forward(self, layer: int, step: StepContext, input_ids: torch.Tensor, positions: torch.Tensor,
                    hidden: torch.Tensor) -> torch.Tensor:
        """MTP layer `layer` over rows pairing the token at position + 1 (`input_ids`) with the
        hidden state of position (`hidden`: the target's final one, or an MTP layer's output):
        writes each row's KV into the layer's cache and returns its output [T, hidden] before
        its head's norm (what the next MTP step continues from)."""
        raise ValueError(f"{type(self).__name__} has no multi-token-prediction layers")

    def mtp_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab_size] of MTP layer `layer`'s outputs x [N, hidden]."""
        raise ValueError(f"{type(self).__name__} has no multi-token-prediction layers")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext,
                output_rows: torch.Tensor | None = None, taps: LayerTaps | None = None,
                hooks: LayerHooks | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states of `output_rows` (all T rows when
        None). Every layer writes the KV of all T rows; the last computes its output projection
        and MLP for the output rows only. `taps` collects chosen layers' inputs; `hooks` run
        around each `attend`."""
        x = self.embed(input_ids)
        last = self.capabilities.num_layers - 1
        for i in range(last + 1):
            if taps is not None:
                taps.offer(i, x)
            inputs = self.before_attention(i, x, positions)
            if hooks is not None:
                hooks.before_attend(i)
            attn_out = self.attend(i, step, inputs)
            if hooks is not None:
                hooks.after_attend(i)
            x = self.after_attention(i, x, attn_out, output_rows if i == last else None)
        return self.final_norm(x)
