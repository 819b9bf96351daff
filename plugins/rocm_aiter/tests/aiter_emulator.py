"""An emulator of AITER's MLA decode entry point, `aiter.mla.mla_decode_fwd`, for machines without
an AMD GPU: AITER's call signature, the checks AITER makes, its kernel lookup in the per-arch
manifest (a call that matches no row raises `EmulatedAbort` where AITER aborts the process), and a
float64 reference in place of the kernels.

Written from AITER's source (ROCm/aiter: aiter/mla.py mla_decode_fwd, csrc/py_itfs_cu/asm_mla.cu
around get_heuristic_kernel_mla, aiter/utility/dtypes.py), without the plugin's own manifest code,
so the two check each other. Only the path the backend takes is emulated: non-persistent (no
work_meta_data), no context parallelism, pages of one token.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "hsa"  # AITER_ASM_DIR of the fixture manifests
FP8_BY_ARCH = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}  # aiter.dtypes.fp8


class EmulatedAbort(RuntimeError):
    """A failed AITER_CHECK: the real library aborts the process here."""


@dataclass(frozen=True)
class EmulatedCall:
    """What one call ran: the manifest row's kernel and the call's shape."""

    kernel: str
    max_seqlen_q: int
    causal: bool
    num_rows: int


class EmulatedAiter:
    """AITER on one arch, with the kernels its manifest under `asm_dir` lists."""

    def __init__(self, arch: str, asm_dir: Path = FIXTURES) -> None:
        self.arch = arch
        self.fp8 = FP8_BY_ARCH[arch]
        with (asm_dir / arch / "mla" / "mla_asm.csv").open(newline="") as f:
            self.rows = list(csv.DictReader(f))
        self.calls: list[EmulatedCall] = []

    def mla_decode_fwd(
        self,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        o: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_lens: torch.Tensor,
        max_seqlen_q: int,
        page_size: int = 1,
        nhead_kv: int = 1,
        sm_scale: float | None = None,
        logit_cap: float = 0.0,
        num_kv_splits: int | None = None,
        num_kv_splits_indptr: torch.Tensor | None = None,
        work_meta_data: torch.Tensor | None = None,
        work_indptr: torch.Tensor | None = None,
        work_info_set: torch.Tensor | None = None,
        reduce_indptr: torch.Tensor | None = None,
        reduce_final_map: torch.Tensor | None = None,
        reduce_partial_map: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,
        intra_batch_mode: bool = False,
        return_logits: bool = False,
        return_lse: bool = False,
        g_kv_indptr: torch.Tensor | None = None,
        cp_world_size: int = 1,
        cp_rank: int = 0,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert logit_cap <= 0, f"{logit_cap=} is not support yet"
        if work_meta_data is not None or g_kv_indptr is not None or page_size != 1:
            raise NotImplementedError("emulated: non-persistent, no context parallelism, page size 1")
        kernel = self._kernel(q, kv_buffer, max_seqlen_q, nhead_kv, causal, q_scale, kv_scale)
        batch = qo_indptr.numel() - 1
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_lens", kv_last_page_lens)):
            assert t.dtype == torch.int32, f"{name} must be int32 (the kernels read 32-bit ints): {t.dtype}"
        # The kernels step through the queries max_seqlen_q rows a request (asm_mla.cu: the query's
        # batch stride is Q.stride(0) * max_seqlen_q): a ragged qo_indptr would be misread.
        uniform = torch.arange(batch + 1, dtype=torch.int32) * max_seqlen_q
        assert torch.equal(qo_indptr.cpu(), uniform), f"qo_indptr {qo_indptr.tolist()} is not uniform"
        assert bool((kv_last_page_lens.cpu() == 1).all()), "pages of one token end after one token"
        assert o.shape[:2] == q.shape[:2], f"o {tuple(o.shape)} does not match q {tuple(q.shape)}"
        scale = sm_scale if sm_scale is not None else q.shape[2] ** -0.5
        out, lse = self._reference(q, kv_buffer, o.shape[2], qo_indptr, kv_indptr, kv_indices, scale,
                                   causal, q_scale, kv_scale)
        o.copy_(out.to(o.dtype))
        self.calls.append(EmulatedCall(kernel, max_seqlen_q, causal, q.shape[0]))
        return o, lse.float() if return_lse else None

    def _type_name(self, t: torch.Tensor, what: str) -> str:
        names = {torch.bfloat16: "bf16", self.fp8: "fp8", torch.uint8: "byte", torch.int8: "byte"}
        if t.dtype not in names or (what == "Q" and names[t.dtype] == "byte"):
            raise EmulatedAbort(f"mla_decode_stage1_asm_fwd: unsupport {what} dtype: {t.dtype}")
        return names[t.dtype]

    def _kernel(
        self,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        max_seqlen_q: int,
        nhead_kv: int,
        causal: bool,
        q_scale: torch.Tensor | None,
        kv_scale: torch.Tensor | None,
    ) -> str:
        """The manifest row asm_mla.cu's non-persistent decode dispatch picks, or EmulatedAbort."""
        if not q.is_contiguous():
            raise EmulatedAbort("only support Q.is_contiguous() for now")
        if nhead_kv != 1:
            raise EmulatedAbort("only support num_kv_heads==1 for now")
        if q.shape[2] != kv_buffer.shape[3]:
            raise EmulatedAbort("only support head_size == KV.size(3) for now")
        q_type, kv_type = self._type_name(q, "Q"), self._type_name(kv_buffer, "KV")
        if q_type == "fp8" and (q_scale is None or kv_scale is None):
            raise EmulatedAbort("fp8 Q requires q_scale and kv_scale")
        gqa = q.shape[1] // nhead_kv
        qlen = max_seqlen_q
        if gqa == 128:
            qlen = 0
        elif gqa == 16 and (q_type, kv_type) == ("bf16", "bf16"):
            qlen = 1 if max_seqlen_q == 1 else 4 if max_seqlen_q <= 4 else 8
        elif gqa == 16 and q_type == "fp8":
            if max_seqlen_q > 4:
                raise EmulatedAbort("only support gqa_ratio=16 fp8 mla decoding with qo_len <= 4")
            qlen = max_seqlen_q if max_seqlen_q <= 2 else 4
        want = {"qType": q_type, "kvType": kv_type, "Gqa": gqa, "ps": 0, "prefill": 0,
                "causal": 1 if max_seqlen_q == 1 else int(causal), "qSeqLen": qlen, "lse": 0, "cprr": 0}
        for row in self.rows:
            if all(str(value) == row.get(column, "0") for column, value in want.items()):
                return row["knl_name"]
        raise EmulatedAbort(f"get_heuristic_kernel_mla: cannot get heuristic kernel! {want} on {self.arch}")

    def _reference(
        self,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        v_head_dim: int,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        sm_scale: float,
        causal: bool,
        q_scale: torch.Tensor | None,
        kv_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 attention of each request's rows over its keys; a row that sees no key: 0, -inf."""
        queries = q.double() * (q_scale.double() if q.dtype == self.fp8 else 1)
        records = kv_buffer.reshape(-1, kv_buffer.shape[-1]).double()
        if kv_buffer.dtype == self.fp8 and kv_scale is not None:
            records = records * kv_scale.double()
        out = torch.zeros(q.shape[0], q.shape[1], v_head_dim, dtype=torch.float64)
        lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64)
        qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
        for b in range(len(qo) - 1):
            rows = queries[qo[b] : qo[b + 1]]  # [Q, H, D]
            keys = records[kv_indices[kv[b] : kv[b + 1]].long()]  # [S, D]
            logits = torch.einsum("qhd,sd->qhs", rows, keys) * sm_scale
            num_q, num_k = rows.shape[0], keys.shape[0]
            if causal:  # row i is at position num_k - num_q + i
                newest = torch.arange(num_q)[:, None] + num_k - num_q
                hidden = torch.arange(num_k)[None, :] > newest
                logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
            row_lse = torch.logsumexp(logits, dim=-1)
            weights = torch.exp(logits - row_lse[..., None]).nan_to_num(0.0)  # rows with no key: all 0
            out[qo[b] : qo[b + 1]] = torch.einsum("qhs,sv->qhv", weights, keys[:, :v_head_dim])
            lse[qo[b] : qo[b + 1]] = row_lse
        return out, lse


class EmulatedAiterWithoutCausal(EmulatedAiter):
    """AITER before mla_decode_fwd took `causal` (ROCm/aiter 45ef304fe5^): every decode is causal."""

    def mla_decode_fwd(  # type: ignore[override]
        self,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        o: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_lens: torch.Tensor,
        max_seqlen_q: int,
        page_size: int = 1,
        nhead_kv: int = 1,
        sm_scale: float | None = None,
        logit_cap: float = 0.0,
        num_kv_splits: int | None = None,
        num_kv_splits_indptr: torch.Tensor | None = None,
        work_meta_data: torch.Tensor | None = None,
        work_indptr: torch.Tensor | None = None,
        work_info_set: torch.Tensor | None = None,
        reduce_indptr: torch.Tensor | None = None,
        reduce_final_map: torch.Tensor | None = None,
        reduce_partial_map: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,
        intra_batch_mode: bool = False,
        return_logits: bool = False,
        return_lse: bool = False,
        g_kv_indptr: torch.Tensor | None = None,
        cp_world_size: int = 1,
        cp_rank: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return super().mla_decode_fwd(
            q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
            page_size, nhead_kv, sm_scale, logit_cap, num_kv_splits, num_kv_splits_indptr,
            work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
            reduce_partial_map, q_scale, kv_scale, intra_batch_mode, return_logits, return_lse,
            g_kv_indptr, cp_world_size, cp_rank,
        )  # fmt: skip
