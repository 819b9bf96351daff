"""DSpark (DeepSeek's DeepSpec, "Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
Generation"): a DFlash backbone (dflash.py: context K/V from the target's tapped layers, one
non-causal block) plus a low-rank Markov head that biases each draft's logits by the token drafted
before it, so the block is sampled left to right.

What this relies on, read from the authors' training code (github.com/deepseek-ai/DeepSpec,
deepspec/modeling/dspark/{common,markov_head}.py and qwen3/{config,modeling}.py):
- config.json: `architectures` ["Qwen3DSparkModel"] (vLLM's speculators packaging names it
  "DSparkDraftModel"), the DFlash fields at the top level (`block_size`, `mask_token_id`,
  `target_layer_ids`, -1 standing for the embedding's output, `num_target_layers`), and
  `markov_rank` r with `markov_head_type` "vanilla" (the gated and RNN heads are refused).
- tensors: DFlash's, plus `markov_head.markov_w1.weight` (an Embedding(V, r) table [V, r]) and
  `markov_head.markov_w2.weight` (a Linear(r, V), [V, r]); the checkpoint's `embed_tokens` and
  `lm_head` are frozen copies of the target's (the target's own are used), and the confidence
  head (which schedules how much of a block to verify) is not read.
- the block: slot j of a block anchored at the newest token t (position N - 1) predicts the token
  at N + j, so the block is [t, MASK x (d - 1)] at positions N - 1 .. N - 2 + d and every slot
  drafts (lookahead k); slot j's logits are the target head's over norm(x_j) plus
  markov_w2(markov_w1[previous]), previous being t for slot 0 and draft j - 1 after it. Each draft
  is sampled (at the request's temperature, from the drafting stream) before the next one's bias
  is formed, and q is the distribution it was drawn from, bias included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from jackfield.models.weights import WeightMapper

from jackfield_spec_decode.dflash import DRAFT_RULES, DFlashDrafter, DraftKind, check_dflash_model

DSPARK = DraftKind(
    "dspark", ("Qwen3DSparkModel", "DSparkDraftModel"), 0, True,
    WeightMapper(rules=DRAFT_RULES, ignore=(r".*rotary_emb\.inv_freq", r"(?:model\.)?embed_tokens\.weight",
                                       r"lm_head\.weight", r"confidence_head\..*")),
)


class DSparkDrafter(DFlashDrafter):
    name = "dspark"
    kind: ClassVar[DraftKind] = DSPARK


def check_dspark_model(model: str | None, target_config: Mapping[str, object]) -> list[str]:
    """`DrafterSpec.check_model`: the draft checkpoint's problems against the target's config.json."""
    return check_dflash_model(model, target_config, DSPARK)
