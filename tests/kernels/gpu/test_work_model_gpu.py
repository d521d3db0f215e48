"""The GPU kernel's work model: the issue's figures (decode, chunked prefill, small batch at long context) and
the model checked against what the kernel does in the Pallas interpreter (per-program KV steps and pages from
its counters, dot shapes from its jaxpr, the cost estimate it hands pallas_call)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu.plan import MMA_MIN_ROWS, gpu_plan_for, plan_gpu
from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu
from pallas_kernels.gpu.work_model import case_work, gpu_work, gpu_work_detail, program_counts
from pallas_kernels.testing import check_case, make_case
from pallas_kernels.work_model import HARDWARE, minimum_kv_bytes

# The model shape: 32 query heads, 8 KV heads, head_dim 128, bfloat16.
QH, KVH, D = 32, 8, 128


def _detail(kv_lens, q_lens, page, num_tokens=None, max_seqs=None, window=None, **overrides):
    num_tokens = num_tokens or sum(q_lens)
    max_seqs = max_seqs or len(q_lens)
    max_blocks = -(-max(kv_lens) // page)
    plan = plan_gpu(num_tokens, max_seqs, max_blocks, QH, KVH, D, page, jnp.bfloat16, **overrides)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return gpu_work_detail(plan, kv_lens, cu, len(q_lens), window)


def _minimum(kv_lens, q_lens, page):
    return minimum_kv_bytes(kv_lens, q_lens, num_kv_heads=KVH, head_dim=D, itemsize=2, page_size=page)


@pytest.mark.parametrize("page", [16, 64])
def test_decode_batch64_reads_kv_once(page):
    kv, q = [4096] * 64, [1] * 64
    detail = _detail(kv, q, page)
    work = detail["work"]
    assert work.kv_bytes_read <= 1.05 * _minimum(kv, q, page)
    assert detail["kv_bytes_gathered"] <= 1.05 * _minimum(kv, q, page)  # even with no L2 reuse at all
    # Issued FLOPs: one token's 4 query heads padded to the 16-row MMA minimum, nothing else.
    assert work.useful_flops == 64 * QH * 4096 * 4 * D
    assert work.issued_flops == work.useful_flops * MMA_MIN_ROWS // (QH // KVH)
    assert work.programs == 64 * KVH


def test_chunked_prefill_kv_bytes():
    kv, q = [4096] * 8, [512] * 8
    detail = _detail(kv, q, 16)
    work = detail["work"]
    assert work.kv_bytes_read <= 2 * _minimum(kv, q, 16)
    # Without L2 reuse every q-block re-reads its sequence's KV: 512 / q_block times at most.
    prefill = plan_gpu(4096, 8, 256, QH, KVH, D, 16, jnp.bfloat16).ranges[0]
    assert prefill.name == "prefill"
    assert detail["kv_bytes_gathered"] <= 512 // prefill.q_block * _minimum(kv, q, 16)
    assert work.issued_flops <= 1.1 * work.useful_flops  # 128-row tiles of one sequence: little waste


@pytest.mark.parametrize("num_tokens,max_seqs", [(4, 4), (16, 8)])  # exact bucket, and the engine's (T 16, S 8)
def test_small_batch_long_context_fills_the_gpu(num_tokens, max_seqs):
    kv, q = [32768] * 4, [1] * 4
    detail = _detail(kv, q, 16, num_tokens=num_tokens, max_seqs=max_seqs)
    assert detail["programs_in_flight"] >= 132
    assert detail["work"].kv_bytes_read <= 1.05 * _minimum(kv, q, 16)


def _brute_force_hbm_pages(plan, kv_lens, cu, num_seqs, window):
    """The wave model by sets: pages each (launch, stream, wave) reads, programs in launch order."""
    total = 0
    for rng in plan.ranges:
        counts, seq, _, first, last = program_counts(plan, rng, kv_lens, cu, num_seqs, window)
        pages, pos = {}, 0
        for h in range(plan.num_kv_heads):
            for i in range(rng.num_items):
                for k in range(rng.num_splits):
                    if counts[k, i, h, 0] == 0:
                        continue
                    key = (int(seq[i]), h, pos // rng.resident_programs)
                    pages.setdefault(key, set()).update(range(int(first[k, i]), int(last[k, i]) + 1))
                    pos += 1
        total += sum(len(p) for p in pages.values())
    return total


@pytest.mark.parametrize("seed", range(6))
def test_hbm_wave_model_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    num_seqs = int(rng.integers(1, 9))
    q_lens = rng.integers(0, 300, num_seqs)
    kv_lens = q_lens + rng.integers(0, 3000, num_seqs)
    page = int(rng.choice([16, 32]))
    window = [None, 700][seed % 2]
    plan = plan_gpu(
        int(q_lens.sum()) + 16,
        8,
        3300 // page + 1,
        QH,
        KVH,
        D,
        page,
        jnp.bfloat16,
        num_splits=int(rng.choice([1, 3])),
        decode_num_splits=[None, 2][seed % 3 == 0],
    )
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    page_bytes = page * D * 2 * 2
    got = gpu_work(plan, kv_lens, cu, num_seqs, window).kv_bytes_read // page_bytes
    assert got == _brute_force_hbm_pages(plan, kv_lens, cu, num_seqs, window)


def _pallas_calls(jaxpr):
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(eqn)
            continue
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                out += _pallas_calls(inner)
    return out


def _dots(jaxpr):
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(tuple(v.aval.shape) for v in eqn.invars))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _dots(inner)
    return out


CASES = [
    # (seqs, num_tokens, max_seqs, q heads, kv heads, page, overrides, window)
    ([(1, 19), (0, 0), (5, 16), (12, 12), (0, 7), (1, 1), (9, 25)], 40, 8, 8, 2, 8, {}, None),  # two ranges
    ([(1, 70), (1, 3), (1, 9), (3, 40)], 8, 8, 8, 2, 8, dict(num_splits=3), None),
    ([(1, 300), (1, 129), (1, 64)], 16, 8, 4, 1, 16, dict(), 100),  # adaptive splits, window
    ([(20, 60), (7, 7), (1, 33)], 32, 4, 4, 2, 8, dict(q_block=8, decode_num_splits=2), 9),
]


@pytest.mark.parametrize("case_idx", range(len(CASES)))
def test_model_matches_interpreted_kernel(case_idx):
    seqs, num_tokens, max_seqs, qh, kvh, page, overrides, window = CASES[case_idx]
    case = make_case(
        case_idx,
        seqs,
        num_tokens=num_tokens,
        max_seqs=max_seqs,
        num_q_heads=qh,
        num_kv_heads=kvh,
        head_dim=64,
        page_size=page,
        max_blocks=64 if case_idx == 2 else None,
    )
    kernel = functools.partial(ragged_paged_attention_gpu, interpret=True, count=True, **overrides)
    plan = gpu_plan_for(
        case.q.shape, case.kv_pages.shape, max_seqs, case.block_tables.shape[1], case.kv_pages.dtype, **overrides
    )
    assert len(plan.ranges) == (1 if plan.decode else 2)
    if case_idx == 2:
        assert plan.ranges[0].adaptive_splits and plan.ranges[0].num_splits > 1
    seen = []

    def run(*args, **opts):
        out, stats = kernel(*args, **opts)
        seen.append([np.asarray(x) for x in stats])
        return out

    check_case(case, run, sliding_window=window, sm_scale=0.125)  # still correct with the counters on
    (counts,) = seen
    detail = gpu_work_detail(plan, case.kv_lens, case.cu_q_lens, int(case.num_seqs[0]), window)
    for got, want in zip(counts, detail["counts"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert detail["kv_steps"] == sum(int(c[..., 0].sum()) for c in counts)
    assert detail["work"].programs == sum(int((c[..., 0] > 0).sum()) for c in counts)

    # Dot shapes in each launch's kernel jaxpr: QK^T [rows, d] x [kv_block, d] and PV [rows, kv_block] x
    # [kv_block, d] per KV step, which is what issued_flops counts (the same pair in each of the KV loops:
    # interior blocks unmasked, boundary blocks masked).
    closed = jax.make_jaxpr(
        functools.partial(
            ragged_paged_attention_gpu, sm_scale=0.125, interpret=True, sliding_window=window, **overrides
        )
    )(*case.paged_args)
    calls = [c for c in _pallas_calls(closed.jaxpr) if "combine" not in str(c.params["name"])]
    assert len(calls) == len(plan.ranges)
    issued = 0
    for call, rng, c in zip(calls, plan.ranges, counts, strict=True):
        dots = _dots(call.params["jaxpr"])
        rows, kvb = rng.rows, rng.kv_block
        pair = [((rows, 64), (kvb, 64)), ((rows, kvb), (kvb, 64))]
        loops = 3 if window is not None else 2
        assert sorted(dots) == sorted(pair * loops)
        per_step = sum(2 * a[0] * a[1] * b[1 if a[1] == b[0] else 0] for a, b in pair)
        issued += int(c[..., 0].sum()) * per_step
        cost = call.params["cost_estimate"]
        assert cost is not None and cost.flops > 0 and cost.bytes_accessed > 0
    assert detail["work"].issued_flops == issued


def test_previous_design_figures():
    """The before/after the issue describes: the previous design ran a batch-4 32k decode on 8 programs (one
    per KV head: the 4 tokens shared one q-block), the new one on >= 132; both read the KV once."""
    kv, q = [32768] * 4, [1] * 4
    cu = np.concatenate([[0], np.cumsum(q)])
    before = case_work(8, 8, QH, KVH, D, 16, jnp.bfloat16, kv, cu, 4, previous=True)
    after = case_work(8, 8, QH, KVH, D, 16, jnp.bfloat16, kv, cu, 4)
    assert before.programs == 8 and after.programs >= 132
    assert before.kv_bytes_read == after.kv_bytes_read == _minimum(kv, q, 16)
    h200 = HARDWARE["h200"]
    assert before.seconds(h200) > 10 * after.seconds(h200)
    # With enough programs the occupancy share is 1: the plain roofline.
    assert after.programs >= h200.num_cores
    assert after.seconds(h200) == max(
        after.hbm_bytes / h200.hbm_bytes_per_s, after.issued_flops / h200.matmul_flops_per_s
    )
    # Decode batch 64: the previous design walked 4 sequences one after another per program (16 rows each:
    # the same 4x MMA padding) on 128 programs, fewer than the SMs; the new one has one program per sequence
    # and KV head.
    kv, q = [4096] * 64, [1] * 64
    cu = np.concatenate([[0], np.cumsum(q)])
    before = case_work(64, 64, QH, KVH, D, 16, jnp.bfloat16, kv, cu, 64, previous=True)
    after = case_work(64, 64, QH, KVH, D, 16, jnp.bfloat16, kv, cu, 64)
    assert before.issued_flops == after.issued_flops == 4 * after.useful_flops
    assert before.programs == 128 and after.programs == 512


@pytest.mark.parametrize("seed", range(4))
def test_item_bounds_hold_for_any_batch_in_the_bucket(seed):
    """Every sequence's q-blocks fit the range's static item bound (an overflow would drop rows silently), each
    real token is in exactly one item of one range, and the ranges split sequences by q_len as planned."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        num_tokens, max_seqs = int(rng.choice([16, 64, 512])), int(rng.choice([8, 64]))
        n = int(rng.integers(1, max_seqs + 1))
        cuts = np.sort(rng.integers(0, num_tokens + 1, n - 1))
        q_lens = np.diff(np.concatenate([[0], cuts, [int(rng.integers(cuts.max(initial=0), num_tokens + 1))]]))
        kv_lens = q_lens + rng.integers(0, 100, n)
        group = int(rng.choice([1, 4, 7]))
        plan = plan_gpu(
            num_tokens, max_seqs, 8, 2 * group, 2, 64, 16, jnp.bfloat16, q_block=[None, 8][int(rng.integers(2))]
        )
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        covered = np.zeros(num_tokens, np.int64)
        for r in plan.ranges:
            member = (q_lens > r.min_q_len) & (q_lens <= r.max_q_len)
            assert int(np.sum(-(-q_lens[member] // r.q_block))) <= r.num_items
            counts, seq, n_tok, first, last = program_counts(plan, r, kv_lens, cu, n)
            for i in np.nonzero(n_tok)[0]:
                t0 = cu[seq[i]] + (i - np.searchsorted(seq, seq[i])) * r.q_block
                covered[t0 : t0 + n_tok[i]] += 1
        assert np.all(covered[: cu[-1]] == 1) and not covered[cu[-1] :].any()


def test_quantized_pages_count_their_scales_and_float32_dots_cost_six():
    """int8 pages read their float32 scale rows with them (2 x 4 bytes per key and KV head beside 2 x head_dim
    values); float32 dots (float32 pages, or float32 queries over int8) are priced as three TF32 products at
    half the bf16 rate, and a compute-bound prefill's roofline time moves by that factor."""
    kv, q = [4096] * 8, [512] * 8
    cu = np.concatenate([[0], np.cumsum(q)])
    plan = lambda kv_dtype, q_dtype: plan_gpu(4096, 8, 256, QH, KVH, D, 16, kv_dtype, q_dtype)
    details = [
        gpu_work_detail(plan(*k), kv, cu, len(q))
        for k in [(jnp.bfloat16, jnp.bfloat16), (jnp.int8, jnp.bfloat16), (jnp.int8, jnp.float32)]
    ]
    bf16, int8, int8_f32q = (d["work"] for d in details)
    assert details[0]["distinct_pages"] == details[1]["distinct_pages"]  # the same tiles walk the same pages
    gathered = [d["kv_bytes_gathered"] for d in details[:2]]
    assert gathered[1] * (2 * D * 2) == gathered[0] * (2 * D + 2 * 4)
    assert (bf16.flop_cost, int8.flop_cost, int8_f32q.flop_cost) == (1.0, 1.0, 6.0)
    h200 = HARDWARE["h200"]
    flops_bound = lambda w: w.issued_flops * w.flop_cost / h200.matmul_flops_per_s
    assert flops_bound(int8_f32q) == pytest.approx(6 * int8_f32q.issued_flops / h200.matmul_flops_per_s)
    assert int8_f32q.seconds(h200) >= flops_bound(int8_f32q)
    assert int8_f32q.seconds(h200) > 3 * int8.seconds(h200)  # the prefill is compute-bound
