"""The TPU kernel's predicted time per call, term by term, from its own plan: which unit bounds each case.

:func:`pallas_kernels.tpu.plan.tpu_work` counts what a call moves and multiplies; this module prices it on one
TensorCore of a named generation. Every count comes from the kernel's plan (block sizes, grid, item lists,
pages per block), the same code the kernel runs, and mirrors what :mod:`pallas_kernels.tpu.ragged_paged_attention`
issues:

- **DMA** (``dma_s``): KV page bytes (quantized pages with their scale rows), queries and outputs, over the
  HBM bandwidth.
- **MXU** (``mxu_s``): every matmul of every (item, KV block, KV head) -- ``q.k^T`` and ``p.v`` -- with its
  rows padded to the MXU width (a weight tile is pushed whole for every product, so a product with fewer
  rows costs as much as one with ``mxu_width`` rows), times the number of bf16 passes (1 for bf16 operands,
  :data:`F32_PASSES` for float32 pages, :data:`SCALE_PASSES` for the quantized pages' per-block scale
  transposition, a product over a ``[kv_block, 2 * num_kv_heads * page_size]`` broadcast).
- **VPU** (``vpu_s``): vector-ALU work in 8x128 vreg operations: masks, the online softmax's elementwise
  steps, the V mask, int8/fp8 -> bf16 casts, the scale broadcast, the prefill item's strided query gather.
- **EUP** (``eup_s``): the exponentials (one per logit, one per row for the running max's correction).
- **fixed** (``fixed_s`` = ``step_s + issue_s``): ``step_s`` per grid step plus one exposed DMA latency per
  call (its first KV block; later blocks are prefetched behind compute); ``issue_s`` per DMA start and wait
  and per guard evaluated (a page past ``kv_len`` still costs its branch).

The call's estimate is ``step + max(dma, issue + max(mxu, vpu, eup))``: the vector units and the MXU run in
parallel (VLIW bundles), the DMA issue is scalar work in the same instruction stream (its branches split the
bundles), and the transfers run behind both through the double buffer. ``bound`` names the term that sets
the time: ``dma`` when the transfers outlast the rest, else the largest of ``mxu``/``vpu``/``eup``, or
``fixed`` when the fixed costs exceed that unit's time. The chip figures below say where each comes from;
the ones marked *estimate* are not published and stay guesses until a TPU run (``scripts/bench/bench_kernels.py``)
replaces them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import cdiv
from pallas_kernels.kv_quant import is_quantized_dtype, page_bytes, scale_row_width
from pallas_kernels.tpu.plan import RangePlan, TpuPlan, item_counts, plan_items
from pallas_kernels.work_model import HARDWARE

_VREG = 8 * 128  # elements of one 32-bit vreg (8 sublanes x 128 lanes)
# bf16 MXU passes of one f32 x f32 product at Precision.HIGHEST (XLA's bf16_6x: each operand split in three
# bf16 parts, six cross products).
F32_PASSES = 6
# bf16 MXU passes of the scale transposition: three one-pass products of the scales' exact bf16 parts
# (:func:`.tpu_ragged_paged_attention.bf16_parts`; it was one f32 HIGHEST product, F32_PASSES).
SCALE_PASSES = 3
# Vector operations per element to split an f32 operand into three bf16 parts (three casts, two converts back,
# two subtractions): paid by every f32 product, whether Mosaic splits it (HIGHEST) or the kernel does.
SPLIT_OPS = 7


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TensorCore's throughputs and fixed costs."""

    name: str
    hbm_bytes_per_s: float
    mxu_flops_per_s: float  # dense bf16 peak of the chip's MXUs
    mxu_width: int  # MXU systolic array side: matmul rows are padded to it
    clock_hz: float
    valu_per_cycle: float  # vreg operations the vector ALUs retire per cycle
    eup_cycles_per_vreg: float  # issue interval of one exp (vpow2) on a vreg
    grid_step_s: float  # fixed cost of one grid step
    dma_issue_s: float  # one guarded DMA start: table read, descriptor, branch
    dma_guard_s: float  # a guarded DMA start or wait whose guard is false (branch only)
    dma_wait_s: float  # one guarded DMA wait that is already satisfied
    dma_latency_s: float  # issue to completion of a small DMA (exposed once per call)


# Sources. HBM bandwidth and bf16 peak: Google Cloud TPU docs (v5e: 819 GB/s, 197 TFLOP/s, four MXUs per
# TensorCore; v6e: 1,640 GB/s, 918 TFLOP/s, 256x256 MXUs). MXU width: 128 on v5e (128x128 MXUs), 256 on v6e
# (Cloud TPU v6e docs). Clock: v5e 1.5 GHz = 197 TFLOP/s / (4 MXUs x 128^2 x 2 FLOP); v6e 1.75 GHz is an
# *estimate* (the same 4-MXU arithmetic at 256^2; the docs' "two 256x256 MXUs" would need 3.5 GHz).
# Vector ALU and EUP rates: measured on TPU v4 in a public cycle-count study (ayaka14732's Pallas TPU tutorial,
# chapter 1: f32 multiply and add issue on separate VALU slots, one per cycle each; EUP vpow2 one vreg every
# 2 cycles; a small HBM->VMEM DMA 445 cycles at 1.05 GHz, issue to wait); *estimates* for v5e/v6e, which may
# have more VALU slots. Grid step 0.35 us: JAX's Pallas TPU guides (the per-iteration pipeline overhead that
# makes larger blocks faster). DMA issue/guard/wait: *estimates* (tens of scalar cycles: SMEM reads are 4
# cycles each in the same study, a descriptor push and a branch); RPA v3 in tpu-inference issues one wait per
# KV block for the same reason.
def _chip(key: str, mxu_width: int, clock_hz: float) -> TpuChip:
    """One generation's chip: its published HBM bandwidth and bf16 peak (`work_model.HARDWARE`, the roofline's
    figures), its MXU width and clock, and the cycle counts above at that clock."""
    hw = HARDWARE[key]
    cycle = 1 / clock_hz
    return TpuChip(
        hw.name, hw.hbm_bytes_per_s, hw.matmul_flops_per_s, mxu_width, clock_hz, 2.0, 2.0, 0.35e-6,
        30 * cycle, 4 * cycle, 10 * cycle, 0.42e-6,
    )  # fmt: skip


CHIPS: dict[str, TpuChip] = {"v5e": _chip("v5e", 128, 1.5e9), "v6e": _chip("v6e", 256, 1.75e9)}

TERMS = ("dma", "mxu", "vpu", "eup", "step", "issue")


@dataclasses.dataclass(frozen=True)
class RangeCost:
    """The counts and seconds of one range's call (decode or prefill)."""

    grid_steps: int
    blocks: int  # (item, KV block) pairs computed
    kv_dmas: int  # page DMAs started (scale-row DMAs included for quantized pages)
    guards: int  # guarded DMA starts and waits evaluated (taken or not)
    hbm_bytes: int
    mxu_flops: int  # issued, rows padded to the MXU width, times bf16 passes
    scale_mxu_flops: int  # of which the quantized pages' scale transposition
    valu_ops: float  # vreg operations
    eup_ops: float  # vreg exponentials
    dma_s: float
    mxu_s: float
    vpu_s: float
    eup_s: float
    step_s: float  # grid steps and the exposed first DMA
    issue_s: float  # DMA starts, waits and guards

    @property
    def fixed_s(self) -> float:
        return self.step_s + self.issue_s

    def term(self, name: str) -> float:
        return getattr(self, f"{name}_s")

    @property
    def seconds(self) -> float:
        return self.step_s + max(self.dma_s, self.issue_s + max(self.mxu_s, self.vpu_s, self.eup_s))


@dataclasses.dataclass(frozen=True)
class TpuEstimate:
    """Both ranges of one kernel call; the calls run one after the other."""

    chip: TpuChip
    decode: RangeCost
    prefill: RangeCost

    def term(self, name: str) -> float:
        return self.decode.term(name) + self.prefill.term(name)

    @property
    def seconds(self) -> float:
        return self.decode.seconds + self.prefill.seconds

    @property
    def bound(self) -> str:
        """The term that sets the call's time (see the module docstring)."""
        compute = max(("mxu", "vpu", "eup"), key=self.term)
        if self.term("dma") >= self.term("issue") + self.term(compute):
            return "dma"
        return "fixed" if self.term("fixed") > self.term(compute) else compute


def grid_steps(rng: RangePlan, real_items: int) -> int:
    """Grid steps the kernel runs for a range with ``real_items`` items: the grid is the real item count (at
    least one step), not the range's static bound (:func:`.tpu_ragged_paged_attention._run_range`)."""
    return max(1, min(real_items, rng.num_items))


def _range_cost(
    chip: TpuChip,
    plan: TpuPlan,
    rng: RangePlan,
    counts: np.ndarray,  # [num_items, 3]: pages DMA'd, blocks computed, masked blocks (tpu_plan.item_counts)
    n: np.ndarray,  # [num_items] query tokens per item
    *,
    kv_dtype,
    q_itemsize: int,
    sliding_window: int | None,
    soft_cap: float | None,
) -> RangeCost:
    d, hkv, ps = plan.head_dim, plan.num_kv_heads, plan.page_size
    quantized = is_quantized_dtype(kv_dtype)
    w, ppb = rng.tokens_per_item, rng.pages_per_block
    kv_block = ppb * ps
    rows = cdiv(plan.group * w, 8) * 8  # the kernel's [group * w] rows in whole sublane tiles
    real = n > 0
    steps = grid_steps(rng, int(real.sum()))
    blocks, masked = int(counts[:, 1].sum()), int(counts[:, 2].sum())
    pages = int(counts[:, 0].sum())
    tokens = int(n.sum())

    # DMA: pages (values and scale rows, lane-dense as the engine's TPU caches hold them), queries and outputs.
    hbm = pages * page_bytes(hkv, ps, d, kv_dtype, dense=True) + 2 * tokens * plan.num_q_heads * d * q_itemsize

    # MXU: q.k^T and p.v per (block, head), rows padded to the MXU width; f32 operands take F32_PASSES.
    passes = F32_PASSES if (not quantized and jnp.dtype(kv_dtype).itemsize == 4) else 1
    m_rows = max(rows, chip.mxu_width)
    attn = blocks * hkv * 2 * (2 * m_rows * d * kv_block) * passes
    width = scale_row_width(hkv, ps, dense=True)  # one page's scale row, padded to whole lanes
    scale = blocks * 2 * max(max(8, 2 * hkv), chip.mxu_width) * width * kv_block * SCALE_PASSES if quantized else 0

    # VPU, in vreg operations (element operations / 1024; bf16 counted as f32, as v5e's VPU computes it). A
    # masked (boundary) block also builds the masks and applies them; other blocks skip both.
    el = lambda x: x / _VREG
    mask_ops = 7 + (2 if sliding_window is not None else 0)  # iotas, % w, +, two compares, and
    mask_block = el(rows * kv_block * mask_ops) + el(kv_block * d * 3)  # the mask and V's row mask
    mask_head = el(rows * kv_block * 2) + el(kv_block * d)  # the selects on logits, p and V
    per_block = 0.0
    logit_ops = 5 + (2 if quantized else 0) + (2 if soft_cap is not None else 0)  # scale, max, -, sum, cast
    per_head = el(rows * kv_block * logit_ops)
    per_head += el(rows * (4 * 128 + 2 * d))  # m, l (lane-replicated) and acc updates
    if passes > 1:  # f32 operands (q, K, p, V) split into bf16 parts for the MXU
        per_head += el((rows * d + 2 * kv_block * d + rows * kv_block) * SPLIT_OPS)
    if quantized:
        per_head += el(kv_block * 2 * d * 2)  # K and V: unpack and convert to the query dtype
        # The scale transposition's broadcast to [kv_block, width], its diagonal mask (iotas, two %, compare,
        # select), its split into three bf16 parts (three casts, two converts back, two subtractions) and the
        # 0/1 selector; masked blocks also select the stale slots out of its result.
        per_block += el(kv_block * width * (7 + SPLIT_OPS)) + el(max(8, 2 * hkv) * (width * 4 + kv_block * 2))
        mask_block += el(max(8, 2 * hkv) * kv_block * 3)
    if w > 1:  # load_q: the group's rows gathered from the [w, num_q_heads, d] buffer (sublane-strided loads)
        per_head += plan.group * cdiv(w, 8) * cdiv(d, 128)
    valu = blocks * (per_block + hkv * per_head) + masked * (mask_block + hkv * mask_head)
    eup = blocks * hkv * (el(rows * kv_block) * (2 if soft_cap is not None else 1) + el(rows * 128))

    # Fixed: grid steps, DMA starts and waits with their guards, one exposed latency per call.
    copies_per_page = 2 if quantized else 1
    guards = blocks * 2 * ppb * copies_per_page  # every block: ppb guarded starts and ppb guarded waits
    kv_dmas = pages * copies_per_page
    token_bits = w.bit_length()
    token_dmas = 2 * sum(bin(int(x)).count("1") for x in n[real])  # query and output copies
    token_guards = int(real.sum()) * 4 * token_bits  # q start, q wait, out start, out wait per bit
    issue = (kv_dmas + token_dmas) * (chip.dma_issue_s + chip.dma_wait_s) + (
        guards + token_guards - 2 * (kv_dmas + token_dmas)
    ) * chip.dma_guard_s
    cycles = 1 / chip.clock_hz
    return RangeCost(
        grid_steps=steps,
        blocks=blocks,
        kv_dmas=kv_dmas,
        guards=guards + token_guards,
        hbm_bytes=hbm,
        mxu_flops=attn + scale,
        scale_mxu_flops=scale,
        valu_ops=valu,
        eup_ops=eup,
        dma_s=hbm / chip.hbm_bytes_per_s,
        mxu_s=(attn + scale) / chip.mxu_flops_per_s,
        vpu_s=valu / chip.valu_per_cycle * cycles,
        eup_s=eup * chip.eup_cycles_per_vreg * cycles,
        step_s=steps * chip.grid_step_s + (chip.dma_latency_s if blocks else 0.0),
        issue_s=issue,
    )


def tpu_estimate(
    plan: TpuPlan,
    kv_lens,
    cu_q_lens,
    num_seqs: int,
    *,
    generation: str,
    kv_dtype=jnp.bfloat16,
    q_dtype=jnp.bfloat16,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> TpuEstimate:
    """The predicted time of one kernel call under ``plan`` for host-known lengths (``kv_lens [max_seqs]``,
    ``cu_q_lens [max_seqs + 1]``) on ``generation`` (a key of :data:`CHIPS`), term by term per range.

    ``plan`` is the kernel's plan for pages of ``kv_dtype`` (:func:`.tpu_ragged_paged_attention.tpu_plan_for`);
    ``q_dtype`` is the queries' dtype (float pages: the kernel casts queries to the page dtype)."""
    chip = CHIPS[generation]
    cu = np.asarray(cu_q_lens, np.int64)
    q_itemsize = jnp.dtype(q_dtype if is_quantized_dtype(kv_dtype) else kv_dtype).itemsize
    costs = []
    for rng, decode, counts in zip(
        (plan.decode, plan.prefill),
        (True, False),
        item_counts(plan, kv_lens, cu, num_seqs, sliding_window),
        strict=True,
    ):
        n = np.asarray(plan_items(np, cu, num_seqs, rng, decode).n, np.int64)
        costs.append(
            _range_cost(
                chip,
                plan,
                rng,
                counts,
                n,
                kv_dtype=kv_dtype,
                q_itemsize=q_itemsize,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
        )
    return TpuEstimate(chip, *costs)
