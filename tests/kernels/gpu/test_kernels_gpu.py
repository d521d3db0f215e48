"""The Triton GPU kernel against the dense reference, in the Pallas interpreter on CPU (compiled on a GPU),
and its lowering to Triton IR for an H200 without one. Pages are ``[pages, kv_heads, page_size, 2 * head_dim]``;
unused pages, slots past ``kv_len`` and padding queries are NaN."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.config import load_model_config
from paged_jax.model import quant
from paged_jax.model.init import param_shapes
from pallas_kernels import dense_reference_attention, kv_quant
from pallas_kernels.analysis.gpu_lowering import pointer_offsets, triton_modules
from pallas_kernels.gpu.plan import plan_gpu
from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu
from pallas_kernels.testing import assert_close, check_case, make_case, random_seqs

MIXED = [(1, 19), (0, 0), (5, 16), (12, 12), (0, 7), (1, 1), (9, 25)]  # decode, chunked, prefill, empty


class TestGpuKernel:
    interpret = True

    def run(
        self,
        case,
        dtype=jnp.float32,
        q_block=4,
        pages_per_block=2,
        num_splits=None,
        decode_q_block=None,
        decode_num_splits=None,
        one_range=False,
        **opts,
    ):
        kernel = functools.partial(
            ragged_paged_attention_gpu,
            interpret=self.interpret,
            q_block=q_block,
            pages_per_block=pages_per_block,
            num_splits=num_splits,
            decode_q_block=decode_q_block,
            decode_num_splits=decode_num_splits,
            one_range=one_range,
        )
        check_case(case, kernel, dtype, **opts)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_mixed_batch(self, dtype):
        case = make_case(
            0,
            MIXED,
            num_tokens=64,
            max_seqs=8,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=128,
            page_size=8,
            dtype=dtype,
        )
        self.run(case, dtype)

    @pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2), (8, 1), (16, 2), (6, 2)])  # 1, 4, MQA, 8, 3
    def test_gqa_and_mqa(self, q_heads, kv_heads):
        case = make_case(
            1,
            [(1, 30), (6, 17), (8, 8)],
            num_tokens=16,
            max_seqs=8,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=64,
            page_size=8,
        )
        self.run(case)

    @pytest.mark.parametrize("head_dim,page_size", [(64, 8), (128, 16), (256, 32), (64, 64), (128, 128), (64, 256)])
    def test_head_dims_and_page_sizes(self, head_dim, page_size):
        case = make_case(
            2,
            [(2, page_size), (3, page_size + 1), (1, 3)],
            num_tokens=16,
            max_seqs=8,
            num_q_heads=2,
            num_kv_heads=1,
            head_dim=head_dim,
            page_size=page_size,
        )
        self.run(case, q_block=8, pages_per_block=1)

    @pytest.mark.parametrize("window,cap", [(1, None), (6, 20.0), (None, 3.0)])
    def test_sliding_window_and_soft_cap(self, window, cap):
        case = make_case(
            3,
            [(1, 45), (10, 30), (16, 16)],
            num_tokens=32,
            max_seqs=8,
            num_q_heads=2,
            num_kv_heads=1,
            head_dim=64,
            page_size=8,
        )
        self.run(case, q_block=8, sliding_window=window, soft_cap=cap)

    @pytest.mark.parametrize(
        "seqs,num_tokens,max_seqs",
        [
            ([(1, 9), (1, 16), (1, 17), (1, 1), (1, 32), (1, 8)], 6, 8),  # pure decode bucket (T <= 2S)
            ([(1, 9), (1, 16), (1, 17), (1, 1), (1, 32), (1, 8), (4, 20), (2, 2)], 16, 8),  # T == 2S: decode
            ([(1, 9), (1, 16), (1, 17), (1, 1), (1, 32), (1, 8), (4, 20), (3, 3)], 17, 8),  # T == 2S+1: prefill
            ([(8, 8), (7, 24), (9, 40), (1, 33), (16, 16)], 48, 8),  # chunks exactly q_block, one under, one over
            ([(4, 4), (4, 12), (4, 20)], 12, 3),  # every q-block ends exactly where a sequence ends
        ],
    )
    def test_decode_prefill_mixed_boundaries(self, seqs, num_tokens, max_seqs):
        """The default plan (decode or prefill config by bucket) at the edges of items and sequences."""
        case = make_case(
            5,
            seqs,
            num_tokens=num_tokens,
            max_seqs=max_seqs,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            page_size=8,
        )
        self.run(case, q_block=None, pages_per_block=None)
        self.run(case, q_block=8, pages_per_block=2)  # q-blocks of 8 tokens: items split chunks mid-page

    @pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
    @pytest.mark.parametrize("window,cap", [(None, None), (5, 10.0)])
    def test_split_kv(self, num_splits, window, cap):
        """Flash-decoding splits: one, a few, and more splits than a sequence has KV blocks (kv 3 and 9 with
        16-key blocks: empty splits must drop out of the combine); decode and a chunk in one batch."""
        case = make_case(
            6,
            [(1, 70), (1, 3), (1, 9), (3, 40), (0, 5)],
            num_tokens=8,
            max_seqs=8,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            page_size=8,
        )
        self.run(case, q_block=4, pages_per_block=2, num_splits=num_splits, sliding_window=window, soft_cap=cap)

    @pytest.mark.parametrize("overrides", [dict(one_range=True), dict(decode_num_splits=3, decode_q_block=8)])
    def test_prefill_bucket_ranges(self, overrides):
        """A prefill bucket: one range with the prefill tiling for every item, or the prefill range plus a decode
        range (sequences of up to the decode tile's tokens: 1, 3 and 8 here) with its own splits."""
        case = make_case(
            9,
            [(1, 40), (20, 20), (3, 33), (0, 4), (8, 70), (9, 9), (1, 1)],
            num_tokens=48,
            max_seqs=8,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            page_size=8,
        )
        self.run(case, q_block=16, pages_per_block=2, **overrides)

    def test_adaptive_splits_small_batch(self):
        """The default plan of a small decode bucket splits KV by itself (the issue's batch-4 case, small)."""
        case = make_case(
            8,
            [(1, 300), (1, 129), (1, 64), (1, 1)],
            num_tokens=16,
            max_seqs=8,
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=64,
            page_size=16,
            dtype=jnp.bfloat16,
            max_blocks=64,
        )
        (rng,) = plan_gpu(16, 8, 64, 4, 1, 64, 16, jnp.bfloat16).ranges
        assert rng.adaptive_splits and rng.num_splits > 1
        self.run(case, jnp.bfloat16, q_block=None, pages_per_block=None)

    @settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        seed=st.integers(0, 2**16),
        page_size=st.sampled_from([8, 16]),
        heads=st.sampled_from([(2, 1), (4, 4), (8, 2)]),
        q_block=st.sampled_from([4, 16]),
    )
    def test_hypothesis(self, seed, page_size, heads, q_block):
        seqs = random_seqs(np.random.default_rng(seed), 32, 8, max_kv=3 * page_size + 1)
        case = make_case(
            seed,
            seqs,
            num_tokens=32,
            max_seqs=8,
            num_q_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=64,
            page_size=page_size,
        )
        self.run(case, q_block=q_block)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGpuKernelCompiled(TestGpuKernel):
    interpret = False


def test_default_block_sizes_through_public_entry_point():
    case = make_case(4, MIXED, num_tokens=64, max_seqs=8, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    check_case(case, "pallas-gpu-interpret")


def _abstract_args(t, s, h, kvh, d, page, blocks, kv_dtype=jnp.bfloat16, num_pages=None):
    sds = jax.ShapeDtypeStruct
    num_pages = num_pages or s * blocks + 1
    kv = sds((num_pages, kvh, page, 2 * d), kv_dtype)
    if kv_quant.is_quantized_dtype(kv_dtype):
        kv = kv_quant.QuantizedPages(kv, sds(kv_quant.scales_shape(num_pages, kvh, page), jnp.float32))
    return (
        sds((t, h, d), jnp.bfloat16),
        kv,
        sds((s,), jnp.int32),
        sds((s, blocks), jnp.int32),
        sds((s + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


@pytest.mark.parametrize(
    "t,s,h,kvh,d,page,blocks",
    [
        (64, 64, 32, 8, 128, 16, 64),  # decode bucket, one split
        (16, 8, 32, 8, 128, 16, 2048),  # small decode batch at 32k: split-KV and the combine
        (512, 8, 14, 2, 64, 16, 256),  # prefill bucket, group 7 padded to 8
    ],
)
def test_lowers_to_triton_for_h200(t, s, h, kvh, d, page, blocks):
    """Pallas -> Triton IR for an H200 (scripts/checks/check_gpu_compile.py compiles it on to SASS, in .venv-gpu)."""
    fn = lambda *a: ragged_paged_attention_gpu(*a, sm_scale=d**-0.5, sliding_window=512, soft_cap=30.0)
    modules = triton_modules(fn, *_abstract_args(t, s, h, kvh, d, page, blocks))
    assert modules and all(m.name.startswith("ragged_paged_attention_gpu") for m in modules)
    assert all("tt.dot" in m.text for m in modules if not m.name.endswith("_combine"))


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,precision,keys",
    [
        (jnp.float32, jnp.float32, "tf32x3", 32),
        (jnp.float32, jnp.int8, "tf32x3", 32),  # int8 values cast to float32 in registers: float32 tiles
        (jnp.bfloat16, jnp.int8, None, 64),
        (jnp.bfloat16, jnp.bfloat16, None, 64),
    ],
)
def test_float32_dots_are_three_tf32_products_on_the_device(q_dtype, kv_dtype, precision, keys):
    """On the device, float32 operands take the tensor cores as three TF32 products (Triton's exact float32 dot
    spills: docs/benchmarks/compile_checks.md) over float32-sized KV steps; 16-bit operands take plain MMAs."""
    args = list(_abstract_args(64, 64, 32, 8, 128, 16, 64, kv_dtype))
    args[0] = jax.ShapeDtypeStruct(args[0].shape, q_dtype)
    (module,) = triton_modules(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.1), *args)
    dots = [line for line in module.text.splitlines() if "tt.dot" in line]
    assert len(dots) == 4  # q @ k and p @ v, in the interior and the boundary loops
    assert {(re.findall(r"inputPrecision = (\w+)", d) or [None])[0] for d in dots} == {precision}
    assert all(f"tensor<16x{keys}xf32>" in d or f"tensor<16x{keys}x" in d for d in dots)


# Bytes of one H200 (h200.txtpb's device_memory_size) and the engine's share of it for KV.
H200_MEMORY_BYTES = 150_754_820_096


def _engine_layer_pages(config_name: str, kv_dtype) -> int:
    """Pages of one layer at the engine's default sizing on one H200 (90% of what the bf16 weights leave)."""
    config = load_model_config(config_name)
    weights = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(param_shapes(config)))
    per_page = quant.kv_bytes_per_token(config, kv_dtype) * 16
    return int((H200_MEMORY_BYTES - weights) * 0.9) // per_page


@pytest.mark.parametrize(
    "config_name,kv_dtype,page_bits",
    [
        ("llama-3.1-8b", jnp.int8, 64),  # 3.5 GB of int8 per layer: 3.4e9 elements, past a signed i32 offset
        ("mistral-7b", jnp.float8_e4m3fn, 64),
        ("qwen2.5-0.5b", jnp.bfloat16, 64),  # 5.6 GB of bf16: jax widens this one itself (over 2^32 bytes)
        ("llama-3.2-1b", jnp.int8, 64),
        ("qwen2.5-0.5b", jnp.int8, 64),
    ],
)
def test_page_offsets_are_64_bit_at_engine_sizes(config_name, kv_dtype, page_bits):
    """Every pointer addition on the page array uses offsets wide enough for its elements, at the page count the
    engine gives that model on an H200 (lowered from shapes only: nothing is allocated)."""
    config = load_model_config(config_name)
    pages = _engine_layer_pages(config_name, kv_dtype)
    kvh, d = config.num_kv_heads, config.head_dim
    elements = pages * kvh * 16 * 2 * d
    assert elements > 2**31  # the case under test: offsets past the reach of a signed 32-bit index
    args = _abstract_args(64, 64, config.num_heads, kvh, d, 16, 512, kv_dtype, num_pages=pages)
    modules = triton_modules(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=d**-0.5), *args)
    (module,) = [m for m in modules if not m.name.endswith("_combine")]  # the combine reads no pages
    elem = {jnp.int8: "i8", jnp.float8_e4m3fn: "f8E4M3FN", jnp.bfloat16: "bf16"}[kv_dtype]
    offsets = pointer_offsets(module.text)
    assert (elem, page_bits) in offsets
    if kv_dtype != jnp.bfloat16:  # q and the output are bf16; only the pages are 1-byte
        assert {bits for e, bits in offsets if e == elem} == {64}, offsets


def test_small_page_arrays_keep_32_bit_offsets():
    """An int8 page array well under 2^31 elements keeps the cheaper 32-bit offsets."""
    args = _abstract_args(64, 64, 32, 8, 128, 16, 64, jnp.int8, num_pages=4097)
    (module,) = triton_modules(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.1), *args)
    assert {bits for e, bits in pointer_offsets(module.text) if e == "i8"} == {32}


def test_positions_past_32k():
    """Long contexts: int32 positions and page indices past 32k, a window skipping most pages."""
    case = make_case(
        7,
        [(1, 40_000), (2, 33_000)],
        num_tokens=16,
        max_seqs=8,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        page_size=256,
        extra_pages=0,
    )
    for window in (None, 1_000):
        out = ragged_paged_attention_gpu(
            *case.paged_args,
            sm_scale=0.125,
            sliding_window=window,
            interpret=True,
            q_block=8,
            pages_per_block=16,
            num_splits=4,
        )
        ref = dense_reference_attention(*case.dense_args, sm_scale=0.125, sliding_window=window)
        assert_close(out, ref, jnp.float32)


def _tf32(x: np.ndarray) -> np.ndarray:
    """float32 rounded to TF32's 10 explicit significand bits (to nearest, as ``cvt.rna.tf32.f32``)."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def test_three_tf32_products_keep_float32_accuracy():
    """The device's float32 dots, emulated: each operand split into TF32 halves, ``a_lo b_hi + a_hi b_lo + a_hi
    b_hi`` with float32 accumulation (TF32 x TF32 products are exact in float32). Attention over 4k random keys
    stays as close to a float64 reference as float32 dots do, far inside the float32 tolerance the kernel tests
    hold the device to (``assert_close``: 2e-5 of the output's scale)."""

    def dot3(a, b):
        ah, bh = _tf32(a), _tf32(b)
        al, bl = _tf32(a - ah), _tf32(b - bh)
        f = lambda x, y: np.matmul(x, y, dtype=np.float32)
        return f(al, bh) + f(ah, bl) + f(ah, bh)

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((16, 128), (4096, 128), (4096, 128)))
    logits = q.astype(np.float64) @ k.T.astype(np.float64) / np.sqrt(128)
    p = np.exp(logits - logits.max(1, keepdims=True))
    ref = p / p.sum(1, keepdims=True) @ v.astype(np.float64)
    errors = {}
    for name, dot in (("tf32x3", dot3), ("f32", lambda a, b: np.matmul(a, b, dtype=np.float32))):
        logits32 = dot(q, k.T) * np.float32(128**-0.5)
        p32 = np.exp(logits32 - logits32.max(1, keepdims=True))
        errors[name] = float(np.max(np.abs(dot(p32, v) / p32.sum(1, keepdims=True) - ref)))
    assert errors["tf32x3"] < 4 * errors["f32"] + 1e-7
    assert errors["tf32x3"] < 2e-5 / 20
    assert float(np.max(np.abs(_tf32(q) - q) / np.abs(q))) > 1e-4  # one TF32 product alone would not do
