"""The speculative-decoding drafter contract and the one lookahead rule connectors use.

Two kinds of drafter:
- a `TokenDrafter` looks at token ids only (n-gram lookup) and drafts after the engine appended
  a step's tokens;
- a `ModelDrafter` runs layers on the engine's device (DeepSeek's MTP layers): the model runner
  calls it inside the step that verified its previous drafts, after the target's forward, with a
  `DraftContext`: the target's hidden states of that same forward (no second target pass) and the
  attention over the drafter's own KV cache layers, paged through the requests' block tables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec, KVCacheDType, StepContext
from jackfield.contracts.model import ModelFamily


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens per request: token_ids[i] has at most num_speculative_tokens entries.

    probabilities[i] (float32 [len(token_ids[i]), vocab], on the device): the distribution each
    draft was drawn from, q in the rejection rule. None: every draft is certain (q one-hot, as
    n-gram lookup), or the request is greedy (only argmax matches count).
    """

    token_ids: list[list[int]]
    probabilities: list[torch.Tensor | None] | None = None


@dataclass(frozen=True)
class DrafterOptions:
    """What a drafter is built from (the config's [speculative] table): the engine calls a
    registered drafter's factory with one of these."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 5  # n-gram lookup: shortest and longest suffix matched
    prompt_lookup_max: int = 5
    model: str | None = None  # a draft checkpoint directory, for drafters with their own weights


class Drafter(ABC):
    """Proposes up to `num_speculative_tokens` tokens per request for the target to verify.
    Subclass `TokenDrafter` or `ModelDrafter`."""

    name: str

    def __init__(self, options: DrafterOptions) -> None:
        if options.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {options.num_speculative_tokens}")
        self.options = options

    @property
    def num_speculative_tokens(self) -> int:
        return self.options.num_speculative_tokens

    @property
    def lookahead_tokens(self) -> int:
        """KV slots past the last verified token that drafting may write.

        The default is one slot per speculative token. A parallel drafter that writes a whole
        block (DFlash-style) or keeps extra mask slots overrides this.
        """
        return self.num_speculative_tokens


class TokenDrafter(Drafter):
    """A drafter that reads token ids only; it drafts after the engine appended a step's tokens."""

    @abstractmethod
    def propose(self, token_ids: Sequence[Sequence[int]]) -> DraftProposal:
        """Draft tokens after each request's verified `token_ids`."""


@dataclass(frozen=True)
class DraftRows:
    """One forward of a model drafter's layer: R rows, each a position of one request. A row at
    position p pairs the hidden state `hidden[r]` it continues from with the token at p + 1."""

    input_ids: torch.Tensor  # int64 [R]: the token after each row's position
    positions: torch.Tensor  # int64 [R]
    hidden: torch.Tensor  # [R, hidden_size]
    step: StepContext  # the drafter's attention: each row's KV is written at its position


class DraftContext(ABC):
    """One engine step as a model drafter sees it: the target's forward has run and verified the
    step's drafts; the engine has not appended the new tokens yet (the model runner implements it).

    `verified` holds every position the target computed this step whose next token is now known
    (prompt chunks, and each decode's verified tokens), over every request of the step, its hidden
    states the target's final ones (after the final norm). `num_drafting` requests draft after
    this step: request r's first draft comes from the output of row `last_rows[r]` of `verified`
    (its newest verified position), and it may draft at most `max_drafts[r]` (>= 1) tokens: what its
    remaining tokens, max_model_len and its reserved KV slots allow.
    """

    model: ModelFamily
    verified: DraftRows
    # per `ModelDrafter.tap_layers` entry: that target layer's input over the verified rows
    taps: tuple[torch.Tensor, ...]
    last_rows: torch.Tensor  # int64 [num_drafting]: rows of `verified`
    max_drafts: list[int]

    @property
    def num_drafting(self) -> int:
        return len(self.max_drafts)

    @abstractmethod
    def draft_rows(self, requests: Sequence[int], draft: int, input_ids: torch.Tensor,
                   hidden: torch.Tensor) -> DraftRows:
        """The rows that draft token `draft` (0-based, >= 1) of `requests` (indices < num_drafting):
        one per request, pairing its draft `draft - 1` (`input_ids`) with the hidden state that
        drafted it (`hidden`), at the position before that draft's. Their KV goes into the
        requests' reserved lookahead slots (a rejected draft's KV is overwritten by a later step)."""

    @abstractmethod
    def block_attention(self, requests: Sequence[int],
                        sizes: Sequence[int]) -> tuple[StepContext, torch.Tensor]:
        """A drafter that drafts in one block (`ModelDrafter.extra_block_rows` set): the attention
        and positions (int64 [sum(sizes)] on the device) of one block of `sizes[i]` rows per
        request `requests[i]`, at positions N - 1 .. N - 2 + sizes[i] of a request with N tokens
        (its newest token's, then the next ones), every row seeing every key of its request up
        to the block's end (non-causal). Their KV goes into the newest token's slot and the
        requests' reserved lookahead slots (overwritten by a later step)."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, requests: Sequence[int], draft: int,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token `draft` of each of `requests` from its row of float32 `logits`: at the
        request's temperature from the drafting noise stream (position + 2**30; argmax where
        greedy), no other filter. Returns (int64 token ids [R] (-1: the row had no finite logit),
        float32 [R, vocab] probabilities the tokens were drawn from, None when every row is greedy)."""


class ModelDrafter(Drafter):
    """A drafter that runs layers on the engine's device, called by the model runner inside the
    step (see `DraftContext`). Its spec's `mtp_layers` says whether it runs the target
    checkpoint's multi-token-prediction layers (the engine then loads them); a drafter with
    layers of its own (a draft checkpoint's) builds them in `load`."""

    @property
    def extra_block_rows(self) -> int | None:
        """None (the default): the drafter drafts a chain of rows, draft j >= 1 from a row at
        N + j - 2 (`DraftContext.draft_rows`). An int e >= 0: it drafts its d tokens from one
        non-causal block of d + e rows at positions N - 1 .. N - 2 + d + e
        (`DraftContext.block_attention`; DFlash: e = 1, DSpark: e = 0), which bounds d by its
        KV slots differently. Its `lookahead_tokens` cover the block."""
        return None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the drafter reads (`DraftContext.taps`, collected by
        the target's forward through `LayerTaps`); none by default. Known once `load` ran."""
        return ()

    def load(self, target: ModelFamily, backends: AttentionBackends, kv_cache_dtype: KVCacheDType,
             first_cache: int) -> list[AttentionLayerSpec]:
        """Build and load the drafter's own layers on the target's device (the engine calls it
        once, after the target loaded) and return the specs of the KV caches they write: the
        engine allocates them after the target's, cache `first_cache + j` in `StepContext`. A
        ValueError names the file and field that rule it out. Default: no layers of its own."""
        return []

    @abstractmethod
    def propose(self, context: DraftContext) -> DraftProposal:
        """Run the drafter's layers over `context.verified` (every step, drafting or not, so its KV
        caches hold every verified position), then draft for the `num_drafting` requests, in order."""


class ChainDrafter(ModelDrafter):
    """A model drafter whose drafts come from a chain of forwards of its own layers, in three
    parts the engine can also call itself: the layers over the verified rows, each further
    draft's rows, and the logits of their outputs. The engine records a pure decode step's whole
    drafting (the verified rows padded as its verify step's rows, then every draft, sampled on
    the device) in a CUDA graph at fixed batch sizes and replays it instead of `propose`, so
    these parts must be recordable: device work only (no host sync, no Python branch on device
    values), the same kernels for any input values."""

    @abstractmethod
    def verified_forward(self, model: ModelFamily, rows: DraftRows, taps: Sequence[torch.Tensor],
                         ) -> torch.Tensor:
        """The layers over `rows` (the verified rows, `DraftContext.verified`, with their `taps`),
        writing their KV: the output [R, H] of each row; a request's newest row drafts token 0."""

    @abstractmethod
    def draft_forward(self, model: ModelFamily, draft: int, rows: DraftRows) -> torch.Tensor:
        """The layers over the rows of draft `draft` >= 1 (`DraftContext.draft_rows`), writing
        their KV: the output [R, H] of each row, which drafts token `draft`."""

    @abstractmethod
    def draft_logits(self, model: ModelFamily, draft: int, out: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, the target's vocabulary] of draft `draft` from outputs `out`."""


def combined_lookahead(drafters: Iterable[Drafter]) -> int:
    """The KV slots a step may write past the verified tokens, over every active drafter."""
    return max((d.lookahead_tokens for d in drafters), default=0)


def exportable_tokens(num_computed_tokens: int, lookahead_tokens: int, num_verified_tokens: int) -> int:
    """How many of a request's KV tokens a connector may export: the verified ones only.

    Draft KV past the verified tokens is never exported. `num_computed_tokens` may include up
    to `lookahead_tokens` unverified slots; the result backs off to the verified count.
    """
    if lookahead_tokens < 0 or num_verified_tokens < 0 or num_computed_tokens < 0:
        raise ValueError("token counts must be >= 0")
    if num_computed_tokens - num_verified_tokens > lookahead_tokens:
        raise ValueError(
            f"{num_computed_tokens - num_verified_tokens} unverified tokens exceed the "
            f"lookahead of {lookahead_tokens}"
        )
    return min(num_computed_tokens, num_verified_tokens)
