"""jackfield-spec-decode: speculative-decoding drafters (the engine verifies what they propose)."""

from __future__ import annotations

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
    ]
