"""AITER's per-arch MLA kernel manifest and the row one decode call needs.

AITER ships one assembly kernel per row of `<AITER_ASM_DIR>/<arch>/mla/mla_asm.csv` and, at each
call, looks for the row that matches the call exactly; when none does, it aborts the process
(csrc/py_itfs_cu/asm_mla.cu, get_heuristic_kernel_mla). So the backend reads the installed
manifest and never calls AITER for a row it lacks. Columns: qType, kvType, Gqa, ps, qSeqLen,
prefill, causal, lse, then knl_name, co_name; gfx950's manifest adds cprr before knl_name.

The backend uses AITER's non-persistent decode (ps = 0). Its row has prefill = 0, lse = 0 (that
path merges the KV splits and their LSE outside the kernel), cprr = 0 (no round-robin context
parallelism), causal = 1 whenever a request has one query row (the mask is a no-op there and AITER
asks for the masked kernel), and the query length padded as AITER pads it (`kernel_query_len`).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

# The head counts whose query-length padding `kernel_query_len` follows (asm_mla.cu's gqa_ratio
# 16 and 128 branches); AITER's other head counts pad by other rules.
SERVED_NUM_HEADS = (16, 128)
KEY_COLUMNS = ("qType", "kvType", "Gqa", "ps", "qSeqLen", "prefill", "causal", "lse")


@dataclass(frozen=True)
class KernelKey:
    """One manifest row's key: what AITER matches a call against."""

    q_type: str  # "bf16", "fp8": AITER's names of the query's and the cache's element types
    kv_type: str
    gqa: int  # query heads per KV head (MLA: the head count; its one latent "head" is shared)
    persistent: int  # ps
    query_len: int  # qSeqLen: query rows per request the kernel is built for; 0: any
    prefill: int
    causal: int
    lse: int  # the kernel writes the LSE itself (persistent kernels only)
    cprr: int = 0

    def describe(self) -> str:
        return (f"qType={self.q_type}, kvType={self.kv_type}, Gqa={self.gqa}, ps={self.persistent}, "
                f"qSeqLen={self.query_len}, prefill={self.prefill}, causal={self.causal}, "
                f"lse={self.lse}, cprr={self.cprr}")


@dataclass(frozen=True)
class KernelManifest:
    """The kernels AITER has for one GPU arch: key -> kernel name."""

    arch: str
    path: Path
    kernels: dict[KernelKey, str]

    def missing_decode_kernel(
        self, q_type: str, kv_type: str, num_heads: int, query_len: int, causal: bool
    ) -> str | None:
        """Why AITER cannot run a non-persistent decode of `query_len` rows per request over
        `num_heads` heads here; None when its manifest lists the kernel."""
        key = decode_kernel_key(q_type, kv_type, num_heads, query_len, causal)
        what = (f"{q_type} queries over a {kv_type} cache, {num_heads} heads, {query_len} query "
                f"rows per request, {'causal' if causal else 'non-causal'}")
        if key is None:
            return f"AITER's MLA decode has no {what} (it aborts before looking for a kernel)"
        if key not in self.kernels:
            return (f"AITER's {self.arch} manifest {self.path} lists no decode kernel for {what} "
                    f"({key.describe()})")
        return None


def read_manifest(path: Path, arch: str) -> KernelManifest:
    """The manifest at `path`; ValueError naming the file and line for a malformed one."""
    kernels: dict[KernelKey, str] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in (*KEY_COLUMNS, "knl_name") if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no column {missing} in the header {reader.fieldnames}")
        for row in reader:
            try:
                key = KernelKey(
                    q_type=row["qType"], kv_type=row["kvType"], gqa=int(row["Gqa"]),
                    persistent=int(row["ps"]), query_len=int(row["qSeqLen"]), prefill=int(row["prefill"]),
                    causal=int(row["causal"]), lse=int(row["lse"]), cprr=int(row.get("cprr") or 0),
                )  # fmt: skip
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}, line {reader.line_num}: {exc}") from None
            kernels[key] = row["knl_name"]
    return KernelManifest(arch, path, kernels)


def kernel_query_len(q_type: str, kv_type: str, num_heads: int, query_len: int) -> int | None:
    """The qSeqLen AITER's non-persistent decode looks up for requests of `query_len` rows, or
    None where it aborts before any lookup (asm_mla.cu):
      128 heads: 0 (one kernel for every length);
      16 heads, bf16 over bf16: 1 -> 1, up to 4 -> 4, more -> 8;
      16 heads, fp8 over fp8: 1, 2, then up to 4 -> 4; more: none;
      16 heads, other types: the length itself."""
    if num_heads not in SERVED_NUM_HEADS:
        raise ValueError(f"AITER's query-length padding is known here for {SERVED_NUM_HEADS} heads, "
                         f"not {num_heads}")
    if query_len < 1:
        raise ValueError(f"a decode request has at least one query row, got {query_len}")
    if num_heads == 128:
        return 0
    if (q_type, kv_type) == ("bf16", "bf16"):
        return 1 if query_len == 1 else 4 if query_len <= 4 else 8
    if q_type == "fp8":
        return query_len if query_len <= 2 else 4 if query_len <= 4 else None
    return query_len


def decode_kernel_key(
    q_type: str, kv_type: str, num_heads: int, query_len: int, causal: bool
) -> KernelKey | None:
    """The manifest key of a non-persistent decode call, or None where AITER has none at all."""
    padded = kernel_query_len(q_type, kv_type, num_heads, query_len)
    if padded is None:
        return None
    return KernelKey(q_type, kv_type, gqa=num_heads, persistent=0, query_len=padded, prefill=0,
                     causal=int(causal or query_len == 1), lse=0, cprr=0)
