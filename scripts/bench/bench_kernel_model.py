"""Estimated device time of the paged-attention kernels, from their work models, before any device run.

For each case (shapes, lengths) it prints, per target (TPU v5e, TPU v6e, H200), the kernel's KV bytes against
the minimum, its issued FLOPs against the useful ones, and the roofline time ``max(bytes / bandwidth, issued
FLOPs / peak)`` next to the ideal (minimum bytes, useful FLOPs) and next to the previous design's figures.
The current figures come from the kernels' own plans (:mod:`pallas_kernels.tpu.plan`,
:mod:`pallas_kernels.gpu.plan`); the previous TPU design (q-blocks of 32 flat tokens that mixed sequences,
every (sequence, KV block) pair computed over all ``group x 32`` rows) is re-derived in :func:`legacy_tpu_work`
from that design's block table. Published chip figures are in :data:`pallas_kernels.work_model.HARDWARE`.
The last table is the TPU kernel's predicted time per term (:mod:`pallas_kernels.analysis.tpu_cost`) for the shipped
configs' decode and prefill steps with bfloat16 and int8 pages, and the unit that bounds each.

    .venv/bin/python scripts/bench/bench_kernel_model.py
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.analysis.tpu_cost import tpu_estimate
from pallas_kernels.common import cdiv
from pallas_kernels.tpu.plan import item_blocks, tpu_work, useful_flops
from pallas_kernels.tpu.ragged_paged_attention import tpu_plan_for
from pallas_kernels.work_model import HARDWARE, KernelWork, minimum_kv_bytes, with_kv_dtype


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    max_seqs: int
    q_lens: list[int]
    kv_lens: list[int]
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16

    def batch(self) -> tuple[np.ndarray, np.ndarray]:
        cu = np.zeros(self.max_seqs + 1, np.int64)
        cu[1 : len(self.q_lens) + 1] = np.cumsum(self.q_lens)
        cu[len(self.q_lens) + 1 :] = cu[len(self.q_lens)]
        lens = np.zeros(self.max_seqs, np.int64)
        lens[: len(self.kv_lens)] = self.kv_lens
        return lens, cu


CASES = [
    Case("decode b64 ctx4096 page16", 64, 64, [1] * 64, [4096] * 64),
    Case("decode b64 ctx4096 page64", 64, 64, [1] * 64, [4096] * 64, page_size=64),
    Case("decode b8 ctx16k", 8, 8, [1] * 8, [16384] * 8),
    Case("decode b4 ctx32k", 8, 8, [1] * 4, [32768] * 4),
    Case("chunked prefill 8x512 ctx4096", 4096, 16, [512] * 8, [4096] * 8),
    Case("mixed 48 decode + 464 chunk", 512, 64, [1] * 48 + [464], [2048] * 48 + [1000]),
    Case("decode b64 ctx4096 hd64 (1B)", 64, 64, [1] * 64, [4096] * 64, head_dim=64),
    # SmolLM2-135M-Instruct (the real model of tests/model/test_smollm2.py): 9 query heads over 3 KV heads of 64
    Case("decode b64 ctx2048 SmolLM2", 64, 64, [1] * 64, [2048] * 64, num_q_heads=9, num_kv_heads=3, head_dim=64),
    Case("prefill 8x256 ctx1024 SmolLM2", 2048, 16, [256] * 8, [1024] * 8, num_q_heads=9, num_kv_heads=3, head_dim=64),
]

# The previous TPU kernel's table: (q tokens per block, KV slots per block) for bf16 by head_dim.
_LEGACY = {
    "v5e": {64: (32, 512), 128: (32, 256), 256: (32, 128)},
    "v6e": {64: (32, 1024), 128: (32, 512), 256: (32, 256)},
}


def legacy_tpu_work(case: Case, generation: str) -> KernelWork:
    """The previous TPU design: grid over blocks of ``q_block`` flat tokens; for every sequence with a token in
    the block, every KV block its rows see, computed over all ``group * q_block`` rows of the block."""
    q_block, slots = _LEGACY[generation][case.head_dim]
    kv_block = max(case.page_size, slots)
    lens, cu = case.batch()
    n = len(case.q_lens)
    group = case.num_q_heads // case.num_kv_heads
    rows = group * q_block
    page_bytes = case.num_kv_heads * case.page_size * 2 * case.head_dim * 2
    pages = blocks = 0
    for start in range(0, case.num_tokens, q_block):
        for s in range(n):
            lo, hi = max(int(cu[s]), start), min(int(cu[s + 1]), start + q_block)
            if lo >= hi:
                continue
            q_len = int(cu[s + 1] - cu[s])
            _, b_lo, b_hi = item_blocks(int(lens[s]), q_len, int(cu[s]), lo, hi - lo, kv_block, None)
            n_pages = cdiv(int(lens[s]), case.page_size)
            per = kv_block // case.page_size
            pages += sum(max(0, min(per, n_pages - b * per)) for b in range(b_lo, b_hi))
            blocks += b_hi - b_lo
    issued = blocks * case.num_kv_heads * 2 * 2 * rows * kv_block * case.head_dim
    useful = useful_flops(case.num_q_heads, case.head_dim, lens, cu, n, None)
    q_bytes = int(cu[n]) * case.num_q_heads * case.head_dim * 2
    return KernelWork(
        pages * page_bytes,
        q_bytes,
        q_bytes,
        issued,
        useful,
        blocks * case.num_kv_heads * rows * kv_block,
        cdiv(case.num_tokens, q_block),
    )


def tpu_case(case: Case, generation: str) -> KernelWork:
    plan = tpu_plan_for(
        (case.num_tokens, case.num_q_heads, case.head_dim),
        (1, case.num_kv_heads, case.page_size, 2 * case.head_dim),
        case.max_seqs,
        32768 // case.page_size,
        jnp.bfloat16,
        generation,
    )
    lens, cu = case.batch()
    return tpu_work(plan, lens, cu, len(case.q_lens))


def gpu_case(case: Case, previous: bool = False) -> KernelWork | None:
    """The GPU kernel's work for the case (None when its plan module is not available)."""
    try:
        from pallas_kernels.gpu.work_model import case_work
    except ImportError:
        return None
    lens, cu = case.batch()
    return case_work(
        case.num_tokens,
        case.max_seqs,
        case.num_q_heads,
        case.num_kv_heads,
        case.head_dim,
        case.page_size,
        jnp.bfloat16,
        lens,
        cu,
        len(case.q_lens),
        previous=previous,
    )


def ideal(case: Case) -> tuple[int, int]:
    lens, cu = case.batch()
    kv = minimum_kv_bytes(
        lens, np.diff(cu), num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, itemsize=2, page_size=case.page_size
    )
    q = int(cu[len(case.q_lens)]) * case.num_q_heads * case.head_dim * 2
    return kv + 2 * q, useful_flops(case.num_q_heads, case.head_dim, lens, cu, len(case.q_lens), None)


def _cells(w: KernelWork, hw, min_kv: int) -> str:
    return (
        f"{w.seconds(hw) * 1e6:>10.1f}{w.kv_bytes_read / min_kv:>6.2f}"
        f"{w.issued_flops / w.useful_flops:>7.1f}{w.exps / 1e6:>7.1f}{w.programs:>6}"
    )


def main() -> None:
    print(
        "bf16, one layer; time = max(HBM bytes / bandwidth, issued FLOPs / peak) in microseconds; "
        "KV = KV bytes read / minimum; FLOP = issued / useful FLOPs; Mexp = softmax exponentials issued "
        "(vector-unit work, not in the time); progs = work items or programs"
    )
    header = (
        f"{'case':<32}{'target':<8}{'ideal us':>9}{'before us':>10}{'KV':>6}{'FLOP':>7}{'Mexp':>7}"
        f"{'progs':>6}{'after us':>10}{'KV':>6}{'FLOP':>7}{'Mexp':>7}{'progs':>6}{'gain':>7}"
    )
    print(header)
    for case in CASES:
        ideal_bytes, ideal_flops = ideal(case)
        lens, cu = case.batch()
        min_kv = minimum_kv_bytes(
            lens,
            np.diff(cu),
            num_kv_heads=case.num_kv_heads,
            head_dim=case.head_dim,
            itemsize=2,
            page_size=case.page_size,
        )
        rows = []
        for target in ("v5e", "v6e"):
            rows.append((target, legacy_tpu_work(case, target), tpu_case(case, target)))
        gpu_after, gpu_before = gpu_case(case), gpu_case(case, previous=True)
        if gpu_after is not None:
            rows.append(("h200", gpu_before, gpu_after))
        for target, before, after in rows:
            hw = HARDWARE[target]
            t_ideal = max(ideal_bytes / hw.hbm_bytes_per_s, ideal_flops / hw.matmul_flops_per_s) * 1e6
            before_s = _cells(before, hw, min_kv) if before is not None else f"{'-':>36}"
            gain = before.seconds(hw) / after.seconds(hw) if before is not None else float("nan")
            print(f"{case.name:<32}{target:<8}{t_ideal:>9.1f}{before_s}{_cells(after, hw, min_kv)}{gain:>6.1f}x")


@dataclasses.dataclass(frozen=True)
class StepModel:
    """A whole decode step of a model: every weight read once, and the attention kernel per layer."""

    name: str
    num_layers: int
    weight_params: int  # matmul weights (projections and LM head), read once per step
    float_params: int  # embeddings and norms, kept in bfloat16 (the embedding is a gather of T rows: not read)
    case: Case


# Llama-3.1-8B: 32 layers, hidden 4096, 32 q / 8 KV heads of 128, MLP 14336, vocab 128256, untied LM head.
LLAMA_8B = StepModel(
    "Llama-3.1-8B decode b64 ctx4096",
    32,
    32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336) + 4096 * 128256,
    0,
    Case("decode b64 ctx4096", 64, 64, [1] * 64, [4096] * 64),
)
# (weight dtype, KV dtype): bytes per weight, KV page dtype
QUANT_MODES = [("bf16", "bf16"), ("int8", "bf16"), ("bf16", "int8"), ("int8", "int8"), ("int8", "fp8_e4m3")]


def quant_table(step: StepModel = LLAMA_8B, target: str = "v5e") -> None:
    """HBM bytes per decode step per quantization mode (weights once, KV through the TPU kernel's plan, scales
    included) and the roofline step time and decode tokens/s; weights dominate until the KV outgrows them."""
    hw = HARDWARE[target]
    kv_dtypes = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}
    layer = tpu_case(step.case, target)  # bfloat16 pages
    print(
        f"\n{step.name} on {target}: HBM bytes per decode step (weights read once; KV = 32 layers of the TPU "
        f"kernel's plan, scales included; per-channel weight scales are < 0.1%)"
    )
    print(f"{'weights':<8}{'KV':<10}{'weight GB':>10}{'KV GB':>8}{'total GB':>9}{'step ms':>9}{'tok/s':>8}")
    for w_mode, kv_mode in QUANT_MODES:
        w_bytes = step.weight_params * (1 if w_mode == "int8" else 2)
        kv = with_kv_dtype(layer, head_dim=step.case.head_dim, itemsize=2, kv_dtype=kv_dtypes[kv_mode])
        kv_bytes = step.num_layers * kv.hbm_bytes
        total = w_bytes + kv_bytes
        t = total / hw.hbm_bytes_per_s
        print(
            f"{w_mode:<8}{kv_mode:<10}{w_bytes / 1e9:>10.2f}{kv_bytes / 1e9:>8.2f}{total / 1e9:>9.2f}"
            f"{t * 1e3:>9.2f}{len(step.case.q_lens) / t:>8.0f}"
        )


# Shipped configs whose attention shapes differ (Mistral-7B, Qwen3-8B and Mixtral share Llama-3.1-8B's).
BREAKDOWN_CONFIGS = ("llama-3.1-8b", "llama-3.2-1b", "qwen2.5-0.5b", "smollm2-135m", "gemma-2-9b")
# (name, num_tokens, max_seqs, q_lens, kv_lens): a full decode bucket, a small one, a chunked-prefill bucket.
BREAKDOWN_STEPS = (
    ("decode b64 ctx4k", 64, 64, [1] * 64, [4096] * 64),
    ("decode b8 ctx512", 16, 8, [1] * 8, [512] * 8),
    ("prefill 8x512 ctx4k", 4096, 16, [512] * 8, [4096] * 8),
)


def breakdown_table(configs=BREAKDOWN_CONFIGS, generations=("v5e", "v6e"), page_size: int = 16) -> None:
    """The TPU kernel's predicted time per layer, term by term (:mod:`pallas_kernels.analysis.tpu_cost`), for the
    shipped
    configs' decode and prefill steps with bfloat16 and int8 pages: which unit bounds each case."""
    from paged_jax.config import load_model_config

    print(
        "\nTPU kernel per layer, predicted (pallas_kernels.analysis.tpu_cost); microseconds per term; time = step +"
        " max(dma, issue + max(mxu, vpu, eup)); mxu(scale) = the int8 pages' scale transposition's share"
    )
    print(
        f"{'config':<14}{'step':<21}{'tpu':<5}{'pages':<6}{'time':>8}{'dma':>8}{'mxu':>8}{'(scale)':>8}"
        f"{'vpu':>8}{'eup':>7}{'step':>7}{'issue':>8}  bound"
    )
    for name in configs:
        cfg = load_model_config(name)
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for step, num_tokens, max_seqs, q_lens, kv_lens in BREAKDOWN_STEPS:
            case = Case(step, num_tokens, max_seqs, q_lens, kv_lens, hq, hkv, d, page_size)
            lens, cu = case.batch()
            for gen in generations:
                for label, kv_dtype in (("bf16", jnp.bfloat16), ("int8", jnp.int8)):
                    plan = tpu_plan_for(
                        (num_tokens, hq, d), (1, hkv, page_size, 2 * d), max_seqs, 32768 // page_size, kv_dtype, gen
                    )
                    e = tpu_estimate(plan, lens, cu, len(q_lens), generation=gen, kv_dtype=kv_dtype)
                    scale = (e.decode.scale_mxu_flops + e.prefill.scale_mxu_flops) / e.chip.mxu_flops_per_s
                    us = lambda t, e=e: e.term(t) * 1e6  # noqa: E731
                    print(
                        f"{name:<14}{step:<21}{gen:<5}{label:<6}{e.seconds * 1e6:>8.1f}{us('dma'):>8.1f}"
                        f"{us('mxu'):>8.1f}{scale * 1e6:>8.1f}{us('vpu'):>8.1f}{us('eup'):>7.1f}{us('step'):>7.1f}"
                        f"{us('issue'):>8.1f}  {e.bound}"
                    )


if __name__ == "__main__":
    main()
    quant_table()
    breakdown_table()
