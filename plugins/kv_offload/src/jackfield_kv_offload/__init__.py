"""jackfield-kv-offload: KV connectors for the KV-connector contract.

`cpu_offload` stores finished chunks of KV blocks in host memory (pinned where CUDA exists) and
loads them back when a later request's prefix is no longer in the device prefix cache. `pd`
hands a prompt's KV from a prefill engine to a decode engine in another process.
"""

from __future__ import annotations

from jackfield.hookspecs import hookimpl
from jackfield.specs import KVConnectorSpec

from jackfield_kv_offload.keys import sliding_window_size_in_chunks
from jackfield_kv_offload.options import check_options, check_pd_options

JACKFIELD_API = ">=1.0,<2"

__all__ = ["JACKFIELD_API", "register_kv_connectors", "sliding_window_size_in_chunks"]


@hookimpl
def register_kv_connectors() -> list[KVConnectorSpec]:
    return [
        KVConnectorSpec(
            name="cpu_offload",
            factory="jackfield_kv_offload.connector:make_cpu_offload",
            check_options=check_options,
            description="KV chunks kept in host memory (LRU or ARC) and loaded back on a prefix hit",
        ),
        KVConnectorSpec(
            name="pd",
            factory="jackfield_kv_offload.pd:make_pd",
            check_options=check_pd_options,
            description="prefill/decode disaggregation: a prefill engine hands each prompt's KV to a "
                        "decode engine in another process (gloo)",
            model_drafters=True,  # a landed block serves only the request that sent it
        ),
    ]
