"""The CPU paged paths (plain XLA, and the C++ kernel of pallas_kernels.cpu.paged) against the dense reference;
write_kv and copy_pages. The kernel's own concerns (work items, build cache, backend choice) are in
test_attention_cpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import copy_pages, dense_reference_attention, ragged_paged_attention, write_kv
from pallas_kernels.common import MASK_VALUE
from pallas_kernels.cpu import paged as cpu_paged
from pallas_kernels.testing import assert_close, check_case, cpu_kernel_path, make_case, random_seqs

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
# Every CPU path runs every semantic case: XLA, the C++ kernel as the engine calls it (backend "cpu", the
# machine's best ISA path), and the kernel forced onto its AVX2 baseline and its portable path. The kernel needs
# a compiler (g++) to build; the AVX2 path needs an AVX2 CPU.
CPU_BACKENDS = [
    "xla",
    pytest.param("cpu", marks=pytest.mark.skipif(not cpu_paged.available(), reason="no g++")),
    *(
        pytest.param(
            cpu_kernel_path(isa),
            id=f"cpu-{isa}",
            marks=pytest.mark.skipif(not cpu_paged.available(isa), reason=f"no {isa} path"),
        )
        for isa in ("avx2", "generic")
    ),
]


def _run(backend, *args, **opts):
    """ragged_paged_attention by a backend name, or a kernel callable."""
    if callable(backend):
        return backend(*args, **opts)
    return ragged_paged_attention(*args, **opts, backend=backend)


def test_reference_matches_naive_numpy():
    """Pins the dense reference itself to a loop over tokens in numpy (causal, window, soft cap)."""
    case = make_case(0, [(3, 5), (1, 9), (0, 4), (4, 4)], num_tokens=16, max_seqs=8, **SHAPE)
    for window, cap in ((None, None), (3, 5.0)):
        ref = np.asarray(dense_reference_attention(*case.dense_args, sm_scale=0.3, soft_cap=cap, sliding_window=window))
        q, k, v = (np.asarray(x, np.float64) for x in (case.q, case.k_dense, case.v_dense))
        cu, lens = np.asarray(case.cu_q_lens), np.asarray(case.kv_lens)
        expect = np.zeros_like(ref)
        for s in range(int(case.num_seqs[0])):
            q_len = cu[s + 1] - cu[s]
            for i in range(q_len):
                x = lens[s] - q_len + i
                keys = [p for p in range(lens[s]) if p <= x and (window is None or p > x - window)]
                for h in range(q.shape[1]):
                    kh = h // (q.shape[1] // k.shape[2])
                    logits = np.array([q[cu[s] + i, h] @ k[s, p, kh] for p in keys]) * 0.3
                    if cap:
                        logits = cap * np.tanh(logits / cap)
                    w = np.exp(logits - logits.max())
                    expect[cu[s] + i, h] = (w / w.sum()) @ v[s, keys, kh]
        np.testing.assert_allclose(ref, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("decode", jnp.float32),
        ("prefill", jnp.float32),
        ("chunked", jnp.float32),
        ("mixed", jnp.float32),
        ("mixed", jnp.bfloat16),
        ("decode", jnp.bfloat16),
    ],
)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xla_batches(kind, dtype, backend):
    seqs = {
        "decode": [(1, 17), (1, 8), (1, 1), (1, 9), (1, 33)],
        "prefill": [(16, 16), (9, 9)],
        "chunked": [(7, 23), (8, 16), (5, 9)],  # kv exact multiple of the page, and one past
        "mixed": [(1, 40), (0, 0), (12, 12), (0, 5), (6, 20), (1, 1)],
    }[kind]
    case = make_case(1, seqs, num_tokens=32, max_seqs=8, dtype=dtype, **SHAPE)
    check_case(case, backend, dtype)


@pytest.mark.parametrize("group", [1, 3, 4, 8, "mqa"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xla_gqa(group, backend):
    kv_heads = 1 if group == "mqa" else 2
    q_heads = 8 if group == "mqa" else kv_heads * group
    case = make_case(
        2,
        [(1, 30), (5, 12), (3, 3)],
        num_tokens=16,
        max_seqs=8,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        page_size=16,
    )
    check_case(case, backend)


@pytest.mark.parametrize("window,cap", [(1, None), (4, None), (13, 30.0), (None, 2.0)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xla_window_and_soft_cap(window, cap, dtype, backend):
    case = make_case(3, [(1, 50), (10, 37), (24, 24)], num_tokens=64, max_seqs=8, dtype=dtype, **SHAPE)
    check_case(case, backend, dtype, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("head_dim,page_size", [(64, 256), (128, 32), (256, 8), (80, 16)])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xla_head_dims_and_pages(head_dim, page_size, backend):
    case = make_case(
        4,
        [(1, page_size), (3, page_size + 1), (2, 2 * page_size)],
        num_tokens=16,
        max_seqs=8,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        page_size=page_size,
    )
    check_case(case, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xla_long_context_positions_past_32k(backend):
    kv = 40_000
    case = make_case(
        5,
        [(1, kv), (2, kv + 7)],
        num_tokens=16,
        max_seqs=8,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        page_size=256,
        extra_pages=0,
    )
    check_case(case, backend)
    check_case(case, backend, sliding_window=33_000)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xla_all_padding_is_zero_and_finite(backend):
    case = make_case(6, [], num_tokens=16, max_seqs=8, **SHAPE)
    out = _run(backend, *case.paged_args, sm_scale=0.1)
    assert not np.any(np.asarray(out))


def test_xla_under_jit():
    case = make_case(7, [(1, 9), (4, 4)], num_tokens=16, max_seqs=8, **SHAPE)
    f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, backend="xla"))
    ref = dense_reference_attention(*case.dense_args, sm_scale=0.125)
    assert_close(f(*case.paged_args), ref, jnp.float32)


def test_validation_errors():
    case = make_case(8, [(1, 9)], num_tokens=16, max_seqs=8, **SHAPE)
    args = list(case.paged_args)
    with pytest.raises(ValueError, match="int32"):
        ragged_paged_attention(*args[:2], args[2].astype(jnp.int16), *args[3:], sm_scale=1.0)
    with pytest.raises(ValueError, match="backend"):
        ragged_paged_attention(*args, sm_scale=1.0, backend="cuda")
    with pytest.raises(ValueError, match="multiple"):
        ragged_paged_attention(args[0][:, :3], *args[1:], sm_scale=1.0)
    assert np.isfinite(MASK_VALUE) and MASK_VALUE < -1e30


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    tokens_log2=st.integers(4, 6),
    seqs_log2=st.integers(3, 4),
    page_size=st.sampled_from([8, 16, 32]),
    heads=st.sampled_from([(1, 1), (4, 1), (4, 4), (8, 2), (9, 3)]),
    window=st.sampled_from([None, 5]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xla_hypothesis(backend, seed, tokens_log2, seqs_log2, page_size, heads, window, dtype):
    rng = np.random.default_rng(seed)
    num_tokens, max_seqs = 2**tokens_log2, 2**seqs_log2
    seqs = random_seqs(rng, num_tokens, max_seqs, max_kv=3 * page_size + 1)
    case = make_case(
        seed,
        seqs,
        num_tokens=num_tokens,
        max_seqs=max_seqs,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        page_size=page_size,
        dtype=dtype,
    )
    check_case(case, backend, dtype, sliding_window=window)


# --- write_kv and copy_pages ---


def _pages(seed, num_pages=6, page_size=8, kv_heads=2, head_dim=64):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_pages, kv_heads, page_size, 2 * head_dim)).astype(np.float32)


def test_write_kv_slots_and_padding():
    pages = _pages(0)
    rng = np.random.default_rng(1)
    k, v = rng.standard_normal((2, 5, 2, 64)).astype(np.float32)
    slots = np.array([9, 47, -1, 8, -5], np.int32)  # page 1 offset 1, page 5 offset 7, pad, page 1 offset 0, pad
    out = np.asarray(write_kv(jnp.asarray(pages), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)))
    expect = pages.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expect[slot // 8, :, slot % 8, :64] = k[t]
            expect[slot // 8, :, slot % 8, 64:] = v[t]
    np.testing.assert_array_equal(out, expect)


def test_write_kv_then_attention_sees_new_token():
    case = make_case(9, [(1, 9)], num_tokens=16, max_seqs=8, **SHAPE)
    page = int(case.block_tables[0, 1])
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rng.standard_normal((16, 2, 64)), jnp.float32) for _ in range(2))
    slots = jnp.full((16,), -1, jnp.int32).at[0].set(page * 8 + 1)  # position 9
    pages = write_kv(case.kv_pages, k, v, slots)
    lens = case.kv_lens.at[0].set(10)
    out = ragged_paged_attention(case.q, pages, lens, *case.paged_args[3:], sm_scale=0.125, backend="xla")
    k_dense = jnp.concatenate([case.k_dense[:, :9], k[None, :1].repeat(8, 0)], axis=1)
    v_dense = jnp.concatenate([case.v_dense[:, :9], v[None, :1].repeat(8, 0)], axis=1)
    ref = dense_reference_attention(case.q, k_dense, v_dense, lens, case.cu_q_lens, case.num_seqs, sm_scale=0.125)
    assert_close(out, ref, jnp.float32)


def test_write_kv_and_copy_pages_in_place_under_donation():
    pages = jnp.asarray(_pages(3))
    ptr = pages.unsafe_buffer_pointer()
    k = v = jnp.ones((4, 2, 64), jnp.float32)
    pages = jax.jit(write_kv, donate_argnums=0)(pages, k, v, jnp.array([0, 1, -1, 2], jnp.int32))
    assert pages.unsafe_buffer_pointer() == ptr
    pages = jax.jit(copy_pages, donate_argnums=0)(pages, jnp.array([1, 0], jnp.int32), jnp.array([3, 0], jnp.int32))
    assert pages.unsafe_buffer_pointer() == ptr


def test_copy_pages_with_padding_pairs():
    pages = _pages(4)
    src = np.array([2, 0, 5, 0], np.int32)
    dst = np.array([4, 0, 1, 0], np.int32)
    out = np.asarray(copy_pages(jnp.asarray(pages), jnp.asarray(src), jnp.asarray(dst)))
    expect = pages.copy()
    expect[4], expect[1] = pages[2], pages[5]
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_path_asks_for_float32_dots_on_float32_queries(dtype):
    """XLA:GPU runs a float32 dot without a precision as TF32; the XLA path asks for HIGHEST on float32 queries
    (both its dots), and leaves bfloat16 dots at the default."""
    from pallas_kernels.xla.paged import xla_ragged_paged_attention

    case = make_case(0, [(1, 20), (5, 9)], num_tokens=8, max_seqs=4, dtype=dtype, **SHAPE)
    text = xla_ragged_paged_attention.lower(*case.paged_args, sm_scale=0.125).as_text()
    assert text.count("dot_general") == 2
    assert text.count("HIGHEST") == (4 if dtype == jnp.float32 else 0)  # [lhs, rhs] of both dots
