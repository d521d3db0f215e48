"""The kernels' work model: HBM bytes and matmul FLOPs of one call, computed from the kernels' own plans.

Each backend exposes a ``plan`` (the static tiling plus the per-call work list its grid walks) and a ``work``
function that sums what that plan moves and issues. Nothing here re-derives a kernel's choices: the numbers
come from the same planning code the kernel runs, so a change of tiling shows up here at once. The figures
feed ``pl.pallas_call(cost_estimate=...)`` and ``scripts/bench/bench_kernels.py``'s device estimates; the TPU
kernel's time per unit (MXU padding, vector and EUP work, fixed costs) is priced in
:mod:`pallas_kernels.analysis.tpu_cost`.

Definitions (per call, one layer):
- ``kv_bytes_read``: bytes of KV pages the kernel copies from HBM (whole pages: a partial last page is read
  whole, as the DMA/gather does).
- ``q_bytes`` / ``out_bytes``: queries read and outputs written.
- ``issued_flops``: ``2 * M * N * K`` of every matmul the kernel issues, M padded to the hardware's row tile
  (8 sublanes on TPU, 16-row MMA on GPU), for both QK^T and PV.
- ``useful_flops``: the same for the rows and keys that are real and visible (causal, window), unpadded.
- ``programs``: independent units of work in flight at once (grid size on GPU; work items on TPU).
- ``flop_cost``: dense-bf16 FLOPs per issued FLOP (float32 dots on the GPU: 6).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import cdiv


@dataclasses.dataclass(frozen=True)
class KernelWork:
    """What one call of a kernel moves and computes. Bytes and FLOPs are totals over the whole call."""

    kv_bytes_read: int
    q_bytes: int
    out_bytes: int
    issued_flops: int
    useful_flops: int
    exps: int  # exponentials evaluated (softmax), over issued rows x keys
    programs: int
    # What one issued FLOP costs in dense-bf16 FLOPs at the chip's matmul peak: 1 for 16-bit operands; 6 for the
    # GPU kernel's float32 dots (three TF32 products, TF32 at half the bf16 rate).
    flop_cost: float = 1.0

    @property
    def hbm_bytes(self) -> int:
        return self.kv_bytes_read + self.q_bytes + self.out_bytes

    def seconds(self, hw: Hardware) -> float:
        """Roofline time: the larger of bytes over bandwidth and issued FLOPs over peak, where a call with
        fewer programs than the chip has cores (SMs) reaches only ``programs / num_cores`` of both (a program
        runs on one core; the previous GPU design ran a batch-4 32k decode on 8 of 132 SMs)."""
        share = min(1.0, self.programs / hw.num_cores) if self.programs else 1.0
        flop_s = self.issued_flops * self.flop_cost / hw.matmul_flops_per_s
        return max(self.hbm_bytes / hw.hbm_bytes_per_s, flop_s) / share


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Published peak figures of one chip (dense bf16 matmul, HBM bandwidth)."""

    name: str
    hbm_bytes_per_s: float
    matmul_flops_per_s: float
    num_cores: int  # TensorCores (TPU) or SMs (GPU)


HARDWARE: dict[str, Hardware] = {
    # Google Cloud TPU docs: v5e 819 GB/s, 197 TFLOP/s bf16, one TensorCore; v6e 1,640 GB/s, 918 TFLOP/s.
    "v5e": Hardware("TPU v5e", 819e9, 197e12, 1),
    "v6e": Hardware("TPU v6e", 1640e9, 918e12, 1),
    # NVIDIA H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16, 132 SMs.
    "h200": Hardware("H200", 4.8e12, 989e12, 132),
}


def minimum_kv_bytes(kv_lens, q_lens, *, num_kv_heads: int, head_dim: int, itemsize: int, page_size: int) -> int:
    """The least KV any correct kernel must read: every page holding a key visible to some query, once."""
    total = 0
    for kv_len, q_len in zip(kv_lens, q_lens, strict=True):
        if q_len > 0:
            total += cdiv(int(kv_len), page_size) * page_size
    return total * 2 * num_kv_heads * head_dim * itemsize


def with_kv_dtype(work: KernelWork, *, head_dim: int, itemsize: int, kv_dtype) -> KernelWork:
    """``work`` (a plan over float pages of ``itemsize`` bytes) with the pages stored as ``kv_dtype``.

    The plans walk the same pages whatever the dtype, so only the bytes change: a slot of one KV head costs
    ``2 * head_dim * kv_itemsize`` bytes, plus ``2 * 4`` bytes of scales for quantized pages (int8, fp8_e4m3:
    each page's scale row is read with it; :mod:`.kv_quant`). Queries and outputs stay in their dtype."""
    from pallas_kernels.kv_quant import bytes_per_token_head

    per_slot = bytes_per_token_head(head_dim, kv_dtype)
    kv = work.kv_bytes_read * per_slot // (2 * head_dim * itemsize)
    return dataclasses.replace(work, kv_bytes_read=kv)
