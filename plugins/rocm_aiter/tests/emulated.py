"""rocm_aiter_mla over the AITER emulator: the backend as it is, its platform probe answering from
an `EmulatedAiter` (a faked arch, the fixture manifests), and the CPU as its device."""

from __future__ import annotations

import dataclasses

from jackfield_rocm_aiter.backend import RocmAiterMLABackend
from jackfield_rocm_aiter.platform import PlatformProbe, platform_from

from .aiter_emulator import FIXTURES, EmulatedAiter


def emulated_backend(aiter: EmulatedAiter) -> type[RocmAiterMLABackend]:
    """The backend calling `aiter`, on the CPU."""
    probe = platform_from(aiter.arch, FIXTURES, aiter.fp8, aiter.mla_decode_fwd)

    class EmulatedRocmAiterMLABackend(RocmAiterMLABackend):
        capabilities = dataclasses.replace(RocmAiterMLABackend.capabilities, devices=("cpu",))

        @classmethod
        def platform_probe(cls) -> PlatformProbe:
            return probe

    return EmulatedRocmAiterMLABackend
