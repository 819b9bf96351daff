"""jackfield-spec-decode: speculative-decoding drafters (the engine verifies what they propose)."""

from __future__ import annotations

from collections.abc import Mapping

from jackfield.hookspecs import hookimpl
from jackfield.specs import DrafterSpec

JACKFIELD_API = ">=1.0,<2"


@hookimpl
def register_drafters() -> list[DrafterSpec]:
    return [
        DrafterSpec(
            name="ngram",
            factory="jackfield_spec_decode.ngram:NgramDrafter",
            description="prompt lookup: what followed the longest earlier match of the last n tokens",
        ),
        DrafterSpec(
            name="mtp",
            factory="jackfield_spec_decode.mtp:MTPDrafter",
            description="DeepSeek multi-token prediction: the target checkpoint's MTP layers",
            mtp_layers=True,
        ),
        DrafterSpec(
            name="eagle3",
            factory="jackfield_spec_decode.eagle3:Eagle3Drafter",
            description="EAGLE-3: a draft head over three of the target's layers ([speculative] model)",
            check_model=check_eagle3_model,
        ),
        DrafterSpec(
            name="dflash",
            factory="jackfield_spec_decode.dflash:DFlashDrafter",
            description="DFlash: a block of drafts from one non-causal draft forward ([speculative] model)",
            check_model=check_dflash_model,
        ),
        DrafterSpec(
            name="dspark",
            factory="jackfield_spec_decode.dspark:DSparkDrafter",
            description="DSpark: DFlash plus a Markov head, the block sampled left to right "
                        "([speculative] model)",
            check_model=check_dspark_model,
        ),
    ]


def check_eagle3_model(model: str | None, target_config: Mapping[str, object]) -> list[str]:
    """The eagle3 draft checkpoint's problems (imports torch only when a config names eagle3)."""
    from jackfield_spec_decode.eagle3 import check_eagle3_model as check

    return check(model, target_config)


def check_dflash_model(model: str | None, target_config: Mapping[str, object]) -> list[str]:
    """The dflash draft checkpoint's problems (imports torch only when a config names dflash)."""
    from jackfield_spec_decode.dflash import check_dflash_model as check

    return check(model, target_config)


def check_dspark_model(model: str | None, target_config: Mapping[str, object]) -> list[str]:
    """The dspark draft checkpoint's problems (imports torch only when a config names dspark)."""
    from jackfield_spec_decode.dspark import check_dspark_model as check

    return check(model, target_config)
