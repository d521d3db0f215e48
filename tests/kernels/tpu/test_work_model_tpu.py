"""The TPU kernel's work model: checked against what the kernel counts in interpret mode, then held to the
issue's efficiency bounds on production shapes (plans only; nothing runs at those sizes)."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.testing import make_case
from pallas_kernels.tpu.plan import item_counts, tpu_work
from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu, tpu_plan_for
from pallas_kernels.work_model import minimum_kv_bytes

MIXED = [(1, 19), (0, 0), (5, 16), (12, 12), (0, 7), (1, 1), (9, 25), (1, 40)]


@pytest.mark.parametrize("window", [None, 9])
def test_model_counts_what_the_kernel_does(window):
    """Pages DMA'd, blocks computed and blocks computed with masks per item: the kernel's own counters equal the
    work model's."""
    case = make_case(
        0, MIXED, num_tokens=32, max_seqs=8, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8, max_blocks=6
    )
    opts = dict(tokens_per_item=4, pages_per_block=2)
    kernel = functools.partial(ragged_paged_attention_tpu, interpret=True, return_stats=True, **opts)
    _, (dec_stats, pre_stats) = kernel(*case.paged_args, sm_scale=0.125, sliding_window=window)
    plan = tpu_plan_for(case.q.shape, case.kv_pages.shape, 8, 6, jnp.float32, **opts)
    want_dec, want_pre = item_counts(plan, case.kv_lens, case.cu_q_lens, int(case.num_seqs[0]), window)
    np.testing.assert_array_equal(np.asarray(dec_stats), want_dec)
    np.testing.assert_array_equal(np.asarray(pre_stats), want_pre)
    assert want_dec[:, 1].sum() > 0 and want_pre[:, 1].sum() > 0  # both ranges did work
    for want in (want_dec, want_pre):  # boundary blocks masked; without a window, the others unmasked
        assert 0 < want[:, 2].sum() <= want[:, 1].sum()
        assert window is not None or want[:, 2].sum() < want[:, 1].sum()


def _batch(q_lens, kv_lens, max_seqs):
    cu = np.zeros(max_seqs + 1, np.int64)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    lens = np.zeros(max_seqs, np.int64)
    lens[: len(kv_lens)] = kv_lens
    return lens, cu


def _work(num_tokens, max_seqs, q_lens, kv_lens, page_size, generation="v5e"):
    max_blocks = 32768 // page_size
    plan = tpu_plan_for((num_tokens, 32, 128), (1, 8, page_size, 256), max_seqs, max_blocks, jnp.bfloat16, generation)
    lens, cu = _batch(q_lens, kv_lens, max_seqs)
    work = tpu_work(plan, lens, cu, len(q_lens))
    minimum = minimum_kv_bytes(lens, np.diff(cu), num_kv_heads=8, head_dim=128, itemsize=2, page_size=page_size)
    return work, minimum


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_decode_issues_at_most_twice_the_useful_flops(page_size, generation):
    """Batch 64, 32 q / 8 KV heads, head_dim 128, context 4096, bf16: rows are one sequence's 4 query heads
    (padded to the 8-row sublane tile), KV read once."""
    work, minimum = _work(64, 64, [1] * 64, [4096] * 64, page_size, generation)
    assert work.issued_flops <= 2 * work.useful_flops
    assert work.kv_bytes_read <= 1.05 * minimum
    assert work.programs == 64


def test_chunked_prefill_streams_kv_at_most_twice():
    """8 sequences x 512-token chunks at context 4096 (a 4096-token bucket)."""
    work, minimum = _work(4096, 16, [512] * 8, [4096] * 8, 16)
    assert work.kv_bytes_read <= 2 * minimum
    assert work.issued_flops <= 2 * work.useful_flops


def test_mixed_batch_reads_each_decode_sequence_once():
    work, minimum = _work(512, 64, [1] * 48 + [464], [2048] * 48 + [1000], 16)
    assert work.kv_bytes_read <= 1.2 * minimum


def _estimate(q_lens, kv_lens, *, num_tokens, max_seqs, heads=(32, 8, 128), kv_dtype=jnp.bfloat16, generation="v5e"):
    from pallas_kernels.analysis.tpu_cost import tpu_estimate

    hq, hkv, d = heads
    plan = tpu_plan_for((num_tokens, hq, d), (1, hkv, 16, 2 * d), max_seqs, 2048, kv_dtype, generation)
    lens, cu = _batch(q_lens, kv_lens, max_seqs)
    return plan, tpu_estimate(plan, lens, cu, len(q_lens), generation=generation, kv_dtype=kv_dtype)


@pytest.mark.parametrize("generation,width", [("v5e", 128), ("v6e", 256)])
def test_mxu_rows_are_padded_to_the_array_width(generation, width):
    """Decode rows (4 query heads, 8 after the sublane tile) cost a whole MXU-wide pass: the priced matmul work is
    the roofline's issued FLOPs times width / 8 (bf16 pages, one pass each)."""
    plan, est = _estimate([1] * 64, [4096] * 64, num_tokens=64, max_seqs=64, generation=generation)
    lens, cu = _batch([1] * 64, [4096] * 64, 64)
    assert est.decode.mxu_flops == tpu_work(plan, lens, cu, 64).issued_flops * width // 8
    assert est.decode.scale_mxu_flops == 0 and est.prefill.blocks == 0


def test_int8_pages_cost_more_compute_per_byte_than_bf16():
    """Same lengths: int8 pages halve the DMA bytes but add the K/V casts and the per-block scale transposition
    (three one-pass bf16 products over a [kv_block, 2 * 8 heads * 16 slots] broadcast, rows padded to 128), so
    their MXU and VPU work per KV byte are several times bf16's, and their scale rows double the page DMAs."""
    _, bf16 = _estimate([1] * 64, [4096] * 64, num_tokens=64, max_seqs=64)
    plan, int8 = _estimate([1] * 64, [4096] * 64, num_tokens=64, max_seqs=64, kv_dtype=jnp.int8)
    assert int8.term("dma") < 0.55 * bf16.term("dma")
    kv_block = plan.decode.pages_per_block * 16
    assert int8.decode.scale_mxu_flops == int8.decode.blocks * 2 * 128 * 256 * kv_block * 3
    assert int8.decode.scale_mxu_flops > 0.2 * int8.decode.mxu_flops
    per_byte = lambda e, t: e.term(t) / e.term("dma")  # noqa: E731
    assert per_byte(int8, "mxu") > 2.5 * per_byte(bf16, "mxu")
    assert per_byte(int8, "vpu") > 4 * per_byte(bf16, "vpu")
    assert int8.decode.kv_dmas == 2 * bf16.decode.kv_dmas
    assert bf16.bound == "dma" and int8.bound != "dma"  # v5e: int8 decode is no longer bandwidth-bound


def test_fixed_costs_dominate_tiny_shapes_and_dma_large_decode():
    """A small model's short decode (Qwen2.5-0.5B: 2 KV heads of 64, 8 KiB pages) is bound by the per-step and
    per-DMA fixed costs; Llama-3.1-8B's large decode by HBM; a long prefill chunk by the vector units."""
    _, tiny = _estimate([1] * 8, [512] * 8, num_tokens=16, max_seqs=8, heads=(14, 2, 64))
    assert tiny.bound == "fixed" and tiny.term("fixed") > 2 * tiny.term("dma")
    _, decode = _estimate([1] * 64, [4096] * 64, num_tokens=64, max_seqs=64)
    assert decode.bound == "dma"
    _, prefill = _estimate([512] * 8, [4096] * 8, num_tokens=4096, max_seqs=16)
    assert prefill.bound in ("vpu", "eup", "mxu") and prefill.term("fixed") < 0.2 * prefill.seconds


def test_decode_only_step_prices_no_prefill_grid_steps():
    """The grid is the range's real item count: a decode-only batch runs one (empty) prefill step, not the
    prefill range's static bound, and a prefill-only batch one decode step."""
    plan, decode = _estimate([1] * 64, [4096] * 64, num_tokens=64, max_seqs=64)
    assert plan.prefill.num_items > 1 and decode.prefill.grid_steps == 1 and decode.decode.grid_steps == 64
    assert decode.prefill.seconds == decode.chip.grid_step_s  # no blocks, no DMA: one step's fixed cost
    _, prefill = _estimate([512] * 8, [4096] * 8, num_tokens=4096, max_seqs=16)
    assert prefill.decode.grid_steps == 1 and prefill.prefill.grid_steps == 16  # 8 chunks x 2 items of 256


def test_only_boundary_blocks_pay_for_masks():
    """A 512-token chunk at the end of a 4096-token context: the blocks before the chunk are computed unmasked,
    so the vector work is far below that of the same blocks all masked."""
    from pallas_kernels.tpu.plan import item_counts

    plan, est = _estimate([512] * 8, [4096] * 8, num_tokens=4096, max_seqs=16)
    lens, cu = _batch([512] * 8, [4096] * 8, 16)
    _, pre = item_counts(plan, lens, cu, 8)
    assert pre[:, 2].sum() < 0.2 * pre[:, 1].sum()  # 7 of every 8 KV blocks lie before the chunk
    assert est.prefill.valu_ops < 0.8 * _all_masked_valu(plan, est)


def _all_masked_valu(plan, est):
    """The prefill range's vector work had every block been masked (the masked share priced on all blocks)."""
    from pallas_kernels.analysis import tpu_cost

    rng = plan.prefill
    lens, cu = _batch([512] * 8, [4096] * 8, 16)
    _, counts = item_counts(plan, lens, cu, 8)
    counts = counts.copy()
    counts[:, 2] = counts[:, 1]
    n = np.asarray(tpu_cost.plan_items(np, cu, 8, rng, False).n, np.int64)
    opts = dict(kv_dtype=jnp.bfloat16, q_itemsize=2, sliding_window=None, soft_cap=None)
    return tpu_cost._range_cost(est.chip, plan, rng, counts, n, **opts).valu_ops


@pytest.mark.parametrize("kv_heads,page_size", [(8, 128), (16, 128), (32, 128), (32, 64)])
def test_vmem_plan_counts_quantized_scale_temporaries(kv_heads, page_size):
    """int8 pages: the scale rows' per-key temporaries grow with KV heads x page size x pages per block; the plan
    counts them and takes fewer pages per block (then shorter prefill items) until a grid step fits the budget
    (`make tpu-check` compiles the 32-head, page-128 int8 prefill that Mosaic refused before: scoped VMEM OOM)."""
    from pallas_kernels import kv_quant
    from pallas_kernels.tpu.plan import _VMEM_BUDGET, vmem_bytes

    width = kv_quant.scale_row_width(kv_heads, page_size, dense=True)
    shape = dict(q_shape=(512, 32, 128), kv_pages_shape=(1, kv_heads, page_size, 256), max_seqs=16, max_blocks=256)
    float_plan = tpu_plan_for(**shape, dtype=jnp.int8, generation="v6e")  # the old plan: scales not counted
    plan = tpu_plan_for(**shape, dtype=jnp.int8, generation="v6e", q_dtype=jnp.bfloat16, scale_width=width)
    for rng, old in ((plan.decode, float_plan.decode), (plan.prefill, float_plan.prefill)):
        assert vmem_bytes(plan, rng) <= _VMEM_BUDGET
        assert vmem_bytes(plan, rng) > vmem_bytes(float_plan, rng)  # the scale terms are counted
        assert rng.pages_per_block <= old.pages_per_block
        if rng.pages_per_block < old.pages_per_block:  # shrunk only as far as needed
            bigger = dataclasses.replace(rng, pages_per_block=2 * rng.pages_per_block)
            assert vmem_bytes(plan, bigger) > _VMEM_BUDGET
    if kv_heads == 32 and page_size == 128:  # the refused shape: 8 MiB per [kv_block, width] temporary at 2 pages
        assert plan.decode.pages_per_block == plan.prefill.pages_per_block == 1
