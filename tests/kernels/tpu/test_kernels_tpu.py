"""The Mosaic TPU kernel against the dense reference, in the TPU interpreter on CPU (compiled on a TPU).

Small shapes: the interpreter runs every DMA and vector op in Python. Block sizes are forced small so that
query blocks straddle sequences and sequences span several KV blocks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import dense_reference_attention
from pallas_kernels.testing import assert_close, check_case, make_case, random_seqs
from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu
from pallas_kernels.tpu.tuned_block_sizes import get_block_sizes, tpu_generation

MIXED = [(1, 19), (0, 0), (5, 16), (12, 12), (0, 7), (1, 1), (9, 25)]  # decode, chunked, prefill, empty


class TestTpuKernel:
    interpret = pltpu.InterpretParams()

    def run(self, case, dtype=jnp.float32, tokens_per_item=4, pages_per_block=2, **opts):
        kernel = functools.partial(
            ragged_paged_attention_tpu,
            interpret=self.interpret,
            tokens_per_item=tokens_per_item,
            pages_per_block=pages_per_block,
        )
        check_case(case, kernel, dtype, **opts)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_mixed_batch(self, dtype):
        case = make_case(
            0,
            MIXED,
            num_tokens=64,
            max_seqs=8,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=128,
            page_size=8,
            dtype=dtype,
        )
        self.run(case, dtype)

    @pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2), (8, 1), (16, 2)])  # GQA 1, 4, MQA, 8
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
        # kv lengths: exactly a multiple of the page size, one past it, and a decode in the first page.
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
        self.run(case, pages_per_block=1)

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
        self.run(case, sliding_window=window, soft_cap=cap)

    def test_default_block_sizes_through_public_entry_point(self):
        case = make_case(4, MIXED, num_tokens=64, max_seqs=8, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
        check_case(case, "pallas-tpu-interpret")

    @pytest.mark.parametrize(
        "seqs",
        [
            [(1, 5), (2, 9), (1, 17)],  # q_len 1 (decode range) beside q_len 2 (prefill range)
            [(4, 4), (5, 21), (8, 8), (3, 11)],  # items of exactly tokens_per_item, one past, two full, short
            [(1, 1), (1, 8), (1, 9), (1, 16)],  # decode only, kv_len at page/block boundaries
            [(7, 7), (9, 30)],  # prefill only
        ],
        ids=["decode-prefill-boundary", "item-boundaries", "decode-only", "prefill-only"],
    )
    def test_range_and_item_boundaries(self, seqs):
        case = make_case(8, seqs, num_tokens=32, max_seqs=8, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
        self.run(case)

    @settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        seed=st.integers(0, 2**16),
        page_size=st.sampled_from([8, 16]),
        heads=st.sampled_from([(2, 1), (4, 4), (8, 2)]),
        pages_per_block=st.sampled_from([1, 3]),
    )
    def test_hypothesis(self, seed, page_size, heads, pages_per_block):
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
        self.run(case, pages_per_block=pages_per_block)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
class TestTpuKernelCompiled(TestTpuKernel):
    interpret = False


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_races_two_cores_dmas_on_wait(dtype):
    """DMAs land only at their wait and the grid is split over two simulated TensorCores; VMEM starts NaN."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait", num_cores_or_threads=2)
    case = make_case(
        5,
        [(1, 20), (7, 9), (0, 0), (8, 24)],
        num_tokens=32,
        max_seqs=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        dtype=dtype,
    )
    out = ragged_paged_attention_tpu(
        *case.paged_args, sm_scale=0.125, interpret=params, tokens_per_item=4, pages_per_block=2
    )
    ref = dense_reference_attention(*case.dense_args, sm_scale=0.125)
    assert ipc.races is not None and not ipc.races.races_found
    assert_close(out, ref, dtype)


def test_block_size_table_and_fallback():
    assert tpu_generation("TPU v5 lite") == "v5e"
    assert tpu_generation("TPU v6 lite") == "v6e"
    assert tpu_generation("TPU v5p") == "v5p"
    assert get_block_sizes(8, 128, jnp.bfloat16, "v6e") == (512, 256, 256)
    # Off-device heuristic: KV buffers within budget for a wide model.
    dec, tokens, pre = get_block_sizes(32, 256, jnp.float32, None)
    assert 16 <= dec and 2 * dec * 2 * 32 * 256 * 4 <= 16 * 2**20 and tokens == 256 and 16 <= pre
    with pytest.raises(ValueError, match="head_dim"):
        case = make_case(
            6, [(1, 3)], num_tokens=16, max_seqs=8, num_q_heads=1, num_kv_heads=1, head_dim=32, page_size=8
        )
        ragged_paged_attention_tpu(*case.paged_args, sm_scale=1.0, interpret=True)


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
        out = ragged_paged_attention_tpu(
            *case.paged_args,
            sm_scale=0.125,
            sliding_window=window,
            interpret=True,
            tokens_per_item=2,
            pages_per_block=16,
        )
        ref = dense_reference_attention(*case.dense_args, sm_scale=0.125, sliding_window=window)
        assert_close(out, ref, jnp.float32)


def test_bf16_parts_sum_to_the_float32_scales_exactly():
    """The quantized pages' scale transposition runs as three one-pass bf16 products of the scales' parts: their
    float32 sum must give back every float32 value bit for bit (random mantissas over 2**-100 .. 2**100, both
    signs), which a plain bf16 cast or a two-part split does not."""
    from pallas_kernels.tpu.ragged_paged_attention import bf16_parts

    rng = np.random.default_rng(0)
    x = (rng.uniform(1, 2, 100_000) * 2.0 ** rng.integers(-100, 100, 100_000)).astype(np.float32)
    x = jnp.asarray(x * rng.choice([-1, 1], x.shape).astype(np.float32))
    hi, mid, lo = (p.astype(jnp.float32) for p in bf16_parts(x))
    assert {hi.dtype, mid.dtype, lo.dtype} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(np.asarray((hi + mid) + lo), np.asarray(x))
    assert not np.array_equal(np.asarray(hi + mid), np.asarray(x))  # two parts are not enough
