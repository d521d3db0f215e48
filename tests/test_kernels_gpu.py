"""The Triton GPU kernel against the dense reference, in the Pallas interpreter on CPU (compiled on a GPU),
and its lowering to Triton IR for an H200 without one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import dense_reference_attention
from pallas_kernels.gpu_ragged_paged_attention import ragged_paged_attention_gpu
from pallas_kernels.testing import assert_close, check_case, make_case, random_seqs

MIXED = [(1, 19), (0, 0), (5, 16), (12, 12), (0, 7), (1, 1), (9, 25)]  # decode, chunked, prefill, empty


class TestGpuKernel:
    interpret = True

    def run(self, case, dtype=jnp.float32, q_block=4, pages_per_block=2, **opts):
        kernel = functools.partial(ragged_paged_attention_gpu, interpret=self.interpret, q_block=q_block,
                                   pages_per_block=pages_per_block)
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

    @pytest.mark.parametrize(
        "head_dim,page_size", [(64, 8), (128, 16), (256, 32), (64, 64), (128, 128), (64, 256)]
    )
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
    case = make_case(
        4, MIXED, num_tokens=64, max_seqs=8, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16
    )
    check_case(case, "pallas-gpu-interpret")


def test_lowers_to_triton_for_h200():
    """Pallas -> Triton IR for an H200 (the Triton compiler itself runs only on a GPU)."""
    t, s, h, kvh, d, page, blocks = 64, 64, 32, 8, 128, 16, 64
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, h, d), jnp.bfloat16),
        sds((s * blocks + 1, page, 2 * kvh, d), jnp.bfloat16),
        sds((s,), jnp.int32),
        sds((s, blocks), jnp.int32),
        sds((s + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    fn = jax.jit(
        lambda *a: ragged_paged_attention_gpu(*a, sm_scale=d**-0.5, sliding_window=512, soft_cap=30.0)
    )
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        exported = export.export(
            fn,
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "ragged_paged_attention_gpu" in text


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
        )
        ref = dense_reference_attention(*case.dense_args, sm_scale=0.125, sliding_window=window)
        assert_close(out, ref, jnp.float32)
