"""Quantized KV pages (int8, fp8_e4m3): the row quantizer, write_kv/copy_pages with scales, and every attention
backend (XLA, the TPU kernel and the GPU kernel in interpret mode) against the dense reference.

The backend tests compare with the reference run on the *dequantized* K/V, so they check that each kernel
reads exactly what is stored (float tolerances of the query dtype); the quantization error itself is bounded
separately, from the formats' rounding (int8: half a step of ``max|x| / 127``; e4m3: 3 mantissa bits)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import copy_pages, dense_reference_attention, kv_quant, ragged_paged_attention, write_kv
from pallas_kernels.common import kv_pages_shape
from pallas_kernels.testing import check_case, make_case

KV_DTYPES = [jnp.int8, jnp.float8_e4m3fn]
MIXED = [(1, 19), (0, 0), (5, 16), (12, 12), (0, 7), (1, 1), (9, 25)]  # decode, chunked, prefill, empty
SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_quantize_rounding_bound(dtype):
    """Every element is within the format's rounding of its row: int8 half a step (scale / 2); e4m3 a relative
    2^-4 (3 mantissa bits) or, below the normal range, half the subnormal step 2^-10 x scale."""
    x = jax.random.normal(jax.random.key(0), (64, 4, 128)) * jnp.exp(jax.random.normal(jax.random.key(1), (64, 4, 1)))
    values, scale = kv_quant.quantize(x, dtype)
    assert values.dtype == dtype and scale.shape == (64, 4) and scale.dtype == jnp.float32
    err = np.abs(np.asarray(values.astype(jnp.float32) * scale[..., None] - x))
    s = np.asarray(scale)[..., None]
    if dtype == jnp.int8:
        bound = 0.5 * s * (1 + 1e-5)
    else:
        bound = np.maximum(2.0**-4 * np.abs(np.asarray(x)), 2.0**-10 * s) * (1 + 1e-5)
    assert np.all(err <= bound)
    # The row maximum maps to the top of the range (no wasted codes).
    top = np.max(np.abs(np.asarray(values.astype(jnp.float32))), axis=-1)
    np.testing.assert_allclose(top, kv_quant.qmax(dtype), rtol=1e-6)
    zeros, zscale = kv_quant.quantize(jnp.zeros((2, 3, 8)), dtype)
    assert np.all(np.asarray(zscale) == 1.0) and not np.any(np.asarray(zeros.astype(jnp.float32)))


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_write_kv_quantized_rows_and_scales(dtype):
    num_pages, heads, page, d = 6, 2, 8, 64
    cache = kv_quant.allocate(num_pages, heads, page, d, dtype)
    k = jax.random.normal(jax.random.key(2), (5, heads, d))
    v = 3.0 * jax.random.normal(jax.random.key(3), (5, heads, d))
    slots = jnp.array([9, 10, -1, 40, 47], jnp.int32)  # page 1 slots 1-2, padding, page 5 slots 0 and 7
    out = jax.jit(write_kv, donate_argnums=0)(cache, k, v, slots)
    assert isinstance(out, kv_quant.QuantizedPages) and out.pages.dtype == dtype
    deq = np.asarray(kv_quant.dequantize_pages(out))
    kq, ks = kv_quant.quantize(k, dtype)
    vq, vs = kv_quant.quantize(v, dtype)
    expect_k = np.asarray(kq.astype(jnp.float32) * ks[..., None])
    expect_v = np.asarray(vq.astype(jnp.float32) * vs[..., None])
    written = np.zeros((num_pages, heads, page), bool)
    for t, slot in enumerate(np.asarray(slots)):
        if slot < 0:
            continue
        p, s = divmod(int(slot), page)
        written[p, :, s] = True
        np.testing.assert_array_equal(deq[p, :, s, :d], expect_k[t])
        np.testing.assert_array_equal(deq[p, :, s, d:], expect_v[t])
    assert not np.any(deq[~written])  # nothing else touched (zeros with unit scales)
    scales = np.asarray(out.scales).reshape(num_pages, heads, 2, page)
    assert np.all(scales[~np.broadcast_to(written[:, :, None, :], scales.shape)] == 1.0)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_copy_pages_copies_scales(dtype):
    pages = jax.random.normal(jax.random.key(4), kv_pages_shape(5, 2, 8, 64))
    cache = kv_quant.quantize_pages(pages, dtype)
    out = copy_pages(cache, jnp.array([1, 3, 0], jnp.int32), jnp.array([4, 2, 0], jnp.int32))
    for src, dst in ((1, 4), (3, 2)):
        np.testing.assert_array_equal(
            np.asarray(out.pages[dst].astype(jnp.float32)), np.asarray(cache.pages[src].astype(jnp.float32))
        )
        np.testing.assert_array_equal(np.asarray(out.scales[dst]), np.asarray(cache.scales[src]))
    np.testing.assert_array_equal(np.asarray(out.scales[1]), np.asarray(cache.scales[1]))


def test_validation():
    case = make_case(0, [(1, 9)], num_tokens=16, max_seqs=8, kv_dtype=jnp.int8, **SHAPE)
    args = list(case.paged_args)
    with pytest.raises(ValueError, match="scales"):
        ragged_paged_attention(args[0], case.kv_pages, *args[2:], sm_scale=1.0, backend="xla")
    bad = kv_quant.QuantizedPages(case.kv_pages, case.kv_scales[:, :8])
    with pytest.raises(ValueError, match="scales"):
        ragged_paged_attention(args[0], bad, *args[2:], sm_scale=1.0, backend="xla")


def _tpu(**kw):
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu

    return functools.partial(ragged_paged_attention_tpu, interpret=pltpu.InterpretParams(), **kw)


def _gpu(**kw):
    from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu

    return functools.partial(ragged_paged_attention_gpu, interpret=True, **kw)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window,cap", [(None, None), (5, 30.0)])
def test_xla_backend_quantized(kv_dtype, dtype, window, cap):
    case = make_case(1, MIXED, num_tokens=64, max_seqs=8, dtype=dtype, kv_dtype=kv_dtype, **SHAPE)
    check_case(case, "xla", dtype, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize(
    "backend,kv_dtype,dtype,window,cap",
    [
        ("tpu", jnp.int8, jnp.float32, None, None),
        ("tpu", jnp.float8_e4m3fn, jnp.bfloat16, 5, 30.0),
        ("gpu", jnp.int8, jnp.bfloat16, 5, 30.0),
        ("gpu", jnp.float8_e4m3fn, jnp.float32, None, None),
    ],
)
def test_pallas_backends_quantized(backend, kv_dtype, dtype, window, cap):
    """Both Pallas kernels in interpret mode, small blocks so items and KV blocks straddle pages and sequences
    (the GPU one with split-KV), head_dim 128, GQA 2."""
    case = make_case(
        2,
        MIXED,
        num_tokens=64,
        max_seqs=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=128,
        page_size=8,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    kernel = (
        _tpu(tokens_per_item=4, pages_per_block=2)
        if backend == "tpu"
        else _gpu(q_block=4, pages_per_block=2, num_splits=2)
    )
    check_case(case, kernel, dtype, sliding_window=window, soft_cap=cap)


def test_lane_dense_scale_rows():
    """TPU stores each page's scale row padded to whole 128-lane multiples (kv_quant.scale_row_width), each TP
    shard's part on its own, and the page budget counts the padding; other platforms keep the exact width."""
    assert kv_quant.lane_dense("tpu") and not kv_quant.lane_dense("gpu") and not kv_quant.lane_dense("cpu")
    assert kv_quant.scale_row_width(2, 16) == 64 and kv_quant.scale_row_width(2, 16, dense=True) == 128
    assert kv_quant.scale_row_width(3, 16, dense=True) == 128 and kv_quant.scale_row_width(8, 16, dense=True) == 256
    assert kv_quant.scales_shape(10, 8, 16, dense=True, shards=8) == (10, 8 * 128)  # 32 columns per chip, padded
    assert kv_quant.scales_shape(10, 8, 16, shards=8) == (10, 256)
    assert kv_quant.page_bytes(2, 16, 64, jnp.int8, dense=True) == 2 * 16 * 128 + 128 * 4
    assert kv_quant.page_bytes(2, 16, 64, jnp.int8) == 2 * 16 * 128 + 64 * 4
    assert kv_quant.page_bytes(2, 16, 64, jnp.bfloat16, dense=True) == 2 * 16 * 128 * 2
    padded = kv_quant.quantize_pages(jax.random.normal(jax.random.key(5), kv_pages_shape(3, 2, 16, 64)), jnp.int8, True)
    assert padded.scales.shape == (3, 128) and np.all(np.asarray(padded.scales[:, 64:]) == 1.0)
    exact = kv_quant.QuantizedPages(padded.pages, padded.scales[:, :64])
    np.testing.assert_array_equal(kv_quant.dequantize_pages(padded), kv_quant.dequantize_pages(exact))


def test_engine_budget_counts_padded_scale_rows(tiny_config):
    """The page count a TPU engine gets divides its budget by pages with padded scale rows."""
    from paged_jax.config.engine import EngineConfig
    from paged_jax.model import quant
    from paged_jax.worker.kv_budget import kv_capacity_pages

    ec, stats = EngineConfig(kv_dtype="int8"), {"bytes_limit": 2**30, "bytes_in_use": 0}
    pages = {
        platform: kv_capacity_pages(tiny_config, ec, jnp.int8, memory_stats=stats, platform=platform)
        for platform in ("tpu", "gpu")
    }
    layer = {d: kv_quant.page_bytes(tiny_config.num_kv_heads, 16, tiny_config.head_dim, jnp.int8, d) for d in (0, 1)}
    assert layer[1] > layer[0]  # tiny: 2 KV heads x 16 slots x K/V = 64 scales, padded to 128
    for platform, dense in (("tpu", 1), ("gpu", 0)):
        assert pages[platform] == int(2**30 * 0.9) // (tiny_config.num_layers * layer[dense])
        per_page = quant.kv_bytes_per_page(tiny_config, jnp.int8, 16, 1, bool(dense))
        assert per_page == tiny_config.num_layers * layer[dense]


@pytest.mark.parametrize("backend", ["xla", "tpu", "gpu"])
def test_lane_dense_scale_rows_read_exactly(backend):
    """Every backend that may meet a lane-dense scale row (XLA, the TPU and GPU kernels in interpret mode) reads
    only the real columns: the padding is NaN here and the result still matches the dense reference."""
    case = make_case(6, MIXED, num_tokens=64, max_seqs=8, kv_dtype=jnp.int8, **SHAPE)  # 2 heads x 8 slots: 32 columns
    scales = jnp.pad(case.kv_scales, ((0, 0), (0, 96)), constant_values=np.nan)
    case = dataclasses.replace(case, kv_scales=scales)
    kernel = {
        "xla": "xla",
        "tpu": _tpu(tokens_per_item=4, pages_per_block=2),
        "gpu": _gpu(q_block=4, pages_per_block=2, num_splits=2),
    }[backend]
    check_case(case, kernel, jnp.float32)


def test_write_kv_leaves_lane_dense_padding():
    """write_kv and copy_pages on lane-dense scale rows write only the real columns of a row."""
    cache = kv_quant.allocate(4, 2, 8, 64, jnp.int8, dense=True)
    assert cache.scales.shape == (4, 128)
    k = jax.random.normal(jax.random.key(7), (3, 2, 64))
    slots = jnp.array([8, 15, 17], jnp.int32)
    out = write_kv(cache, k, 2.0 * k, slots)
    exact = write_kv(kv_quant.allocate(4, 2, 8, 64, jnp.int8), k, 2.0 * k, slots)
    np.testing.assert_array_equal(np.asarray(out.scales[:, :32]), np.asarray(exact.scales))
    assert np.all(np.asarray(out.scales[:, 32:]) == 1.0)
    copied = copy_pages(out, jnp.array([1], jnp.int32), jnp.array([3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(copied.scales[3]), np.asarray(out.scales[1]))


@pytest.mark.parametrize("kv_dtype,bound", [(jnp.int8, 0.02), (jnp.float8_e4m3fn, 0.075)])
def test_attention_quantization_error_bound(kv_dtype, bound):
    """Attention over quantized pages against the float pages they came from (random K/V, unit normal): the
    output error relative to the output's scale. int8 keeps each K/V element within 0.4% of its row's max
    (half of 1/127), e4m3 within 6.25% relative; measured over seeds 0-5 of this batch: 0.44-0.82% (int8) and
    3.1-3.7% (e4m3) at the worst element; the bounds leave about 2x over the worst seed."""
    float_case = make_case(3, MIXED, num_tokens=64, max_seqs=8, **SHAPE)
    quant_case = make_case(3, MIXED, num_tokens=64, max_seqs=8, kv_dtype=kv_dtype, **SHAPE)
    ref = np.asarray(dense_reference_attention(*float_case.dense_args, sm_scale=0.125))
    out = np.asarray(ragged_paged_attention(*quant_case.paged_args, sm_scale=0.125, backend="xla"))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err < bound, err


def test_work_model_bytes_of_quantized_pages():
    """The TPU plan over int8 pages reads each page's values (1 byte per element) and its scale row (8 bytes per
    slot and head), with the same page count as bfloat16 pages: 264 / 512 of the bytes at head_dim 128."""
    from pallas_kernels.tpu.plan import item_counts, tpu_work
    from pallas_kernels.tpu.ragged_paged_attention import tpu_plan_for
    from pallas_kernels.work_model import with_kv_dtype

    heads, page, d = 8, 16, 128
    plan = tpu_plan_for((8, 32, d), (1, heads, page, 2 * d), 8, 64, jnp.bfloat16, "v5e")
    lens, cu = np.array([100, 513, 7, 0, 0, 0, 0, 0]), np.array([0, 1, 2, 3, 3, 3, 3, 3, 3])
    work = tpu_work(plan, lens, cu, 3)
    pages = sum(int(c[:, 0].sum()) for c in item_counts(plan, lens, cu, 3))
    q8 = with_kv_dtype(work, head_dim=d, itemsize=2, kv_dtype=jnp.int8)
    assert q8.kv_bytes_read == pages * (heads * page * 2 * d + kv_quant.scales_shape(1, heads, page)[1] * 4)
    assert q8.kv_bytes_read / work.kv_bytes_read == pytest.approx(264 / 512)
    assert q8.q_bytes == work.q_bytes and q8.issued_flops == work.issued_flops


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("t,s,blocks", [(64, 64, 64), (16, 8, 2048)])  # one split; split-KV and the combine
def test_gpu_kernel_lowers_to_triton_with_quantized_pages(kv_dtype, t, s, blocks):
    """Pallas -> Triton IR for an H200 with int8 / e4m3 pages and their scales (no GPU needed to lower)."""
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh

    from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu

    h, kvh, d, page = 32, 8, 128, 16
    sds = jax.ShapeDtypeStruct
    num_pages = s * blocks + 1
    args = (
        sds((t, h, d), jnp.bfloat16),
        kv_quant.QuantizedPages(
            sds((num_pages, kvh, page, 2 * d), kv_dtype), sds(kv_quant.scales_shape(num_pages, kvh, page), jnp.float32)
        ),
        sds((s,), jnp.int32),
        sds((s, blocks), jnp.int32),
        sds((s + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    fn = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=d**-0.5, sliding_window=512))
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        exported = export.export(
            fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        )(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_tpu_scale_writer_matches_the_scatter():
    """The TPU scale writer (pallas_kernels.tpu.scale_write, interpret mode, race detection once) writes exactly
    what the XLA scatter writes: tokens of one page out of order and in different chunks of the kernel's grid
    (8 rows each here), padding, a stacked cache's page offset; nothing else changes (the rest random)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.tpu import scale_write as tpu_scale_write

    heads, page, pages = 2, 8, 40
    cache = kv_quant.allocate(pages, heads, page, 64, jnp.int8, dense=True)
    cache = cache._replace(scales=jax.random.uniform(jax.random.key(8), cache.scales.shape, minval=0.5, maxval=2.0))
    slots = np.full(20, -1, np.int32)
    slots[:6] = [83, 80, 81, 9, -1, 200]  # page 10 out of order, page 1, padding, page 25
    slots[[7, 11, 19]] = [319, 82, 84]  # the last slot of the last page; page 10 again in chunks 2 and 3
    slots = jnp.asarray(slots)
    page_ids = jnp.where(slots < 0, pages, slots // page)
    k = jax.random.normal(jax.random.key(9), (slots.size, heads, 64))
    values = jnp.stack(kv_quant.quantize(k, jnp.int8)[1:] + kv_quant.quantize(0.5 * k, jnp.int8)[1:], -1)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait")
    got = tpu_scale_write.write_scales_tpu(
        cache.scales, page_ids, slots % page, values.reshape(-1, 2 * heads), page, params, chunk=8
    )
    assert ipc.races is not None and not ipc.races.races_found
    want = write_kv(cache, k, 0.5 * k, slots)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.scales))
    changed = np.any(np.asarray(want.scales) != np.asarray(cache.scales), axis=1)
    assert sorted(np.flatnonzero(changed)) == [1, 10, 25, 39]
    # Through write_kv (the engine's TPU path, default chunk), the slots relative to a page offset of 1.
    shifted = jnp.where(slots < 0, -1, slots - page)
    stacked = write_kv(cache, k, 0.5 * k, shifted, jnp.int32(1), "pallas-tpu-interpret")
    np.testing.assert_array_equal(np.asarray(stacked.scales), np.asarray(want.scales))
    np.testing.assert_array_equal(np.asarray(stacked.pages), np.asarray(want.pages))
