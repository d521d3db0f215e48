"""The C++ CPU kernel (pallas_kernels.cpu_paged) against the dense reference, and the backend choice on CPU.

Every case poisons the slots a correct kernel never reads (NaN: null page, unused pages, slots past kv_len,
padding queries), so reading one fails the comparison."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import cpu_paged, dense_reference_attention, ragged_paged_attention, resolve_backend
from pallas_kernels.testing import assert_close, check_case, make_case, random_seqs

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="the CPU kernel needs a C++ compiler (g++)")

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
BATCHES = {
    "decode": [(1, 17), (1, 8), (1, 1), (1, 9), (1, 33)],
    "prefill": [(16, 16), (9, 9)],
    "chunked": [(7, 23), (8, 16), (5, 9)],  # kv exact multiple of the page, and one past
    "mixed": [(1, 40), (0, 0), (12, 12), (0, 5), (6, 20), (1, 1)],
}


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_batches(kind, dtype):
    case = make_case(1, BATCHES[kind], num_tokens=32, max_seqs=8, dtype=dtype, **SHAPE)
    check_case(case, "cpu", dtype)


def test_cpu_long_prompt_spans_several_work_items():
    """A 70-token prompt is cut into blocks of 32 query tokens per work item; every block sees the right keys."""
    case = make_case(9, [(70, 75), (1, 3)], num_tokens=128, max_seqs=4, **SHAPE)
    check_case(case, "cpu")


@pytest.mark.parametrize("group", [1, 3, 8, "mqa"])
def test_cpu_gqa(group):
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
    check_case(case, "cpu")


@pytest.mark.parametrize("window,cap", [(1, None), (4, None), (13, 30.0), (None, 2.0)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_window_and_soft_cap(window, cap, dtype):
    case = make_case(3, [(1, 50), (10, 37), (24, 24)], num_tokens=64, max_seqs=8, dtype=dtype, **SHAPE)
    check_case(case, "cpu", dtype, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("head_dim,page_size", [(64, 256), (128, 32), (256, 8), (80, 16)])
def test_cpu_head_dims_and_pages(head_dim, page_size):
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
    check_case(case, "cpu")


def test_cpu_long_context_with_window():
    kv = 40_000
    case = make_case(
        5, [(1, kv), (2, kv + 7)], num_tokens=16, max_seqs=8, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=256
    )
    check_case(case, "cpu")
    check_case(case, "cpu", sliding_window=1000)


def test_cpu_all_padding_is_zero():
    case = make_case(6, [], num_tokens=16, max_seqs=8, **SHAPE)
    assert not np.any(np.asarray(ragged_paged_attention(*case.paged_args, sm_scale=0.1, backend="cpu")))


def test_auto_backend_on_cpu_is_the_kernel_and_runs_under_jit():
    assert resolve_backend("auto", "cpu") == "cpu"
    case = make_case(7, [(1, 9), (4, 4)], num_tokens=16, max_seqs=8, **SHAPE)
    f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125))
    assert "paged_jax_paged_attention" in f.lower(*case.paged_args).as_text()
    assert_close(f(*case.paged_args), dense_reference_attention(*case.dense_args, sm_scale=0.125), jnp.float32)


def test_quantized_pages_take_the_xla_path():
    """int8 pages (with scales) are outside the kernel: backend 'cpu' routes them to the XLA path, exactly."""
    case = make_case(8, [(1, 20), (5, 9)], num_tokens=16, max_seqs=8, kv_dtype=jnp.int8, **SHAPE)
    f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, backend="cpu"))
    assert "paged_jax_paged_attention" not in f.lower(*case.paged_args).as_text()
    check_case(case, "cpu")


def test_library_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    """The build lands in the cache under a key of source, compiler, jaxlib and CPU flags; a second build
    finds it and compiles nothing."""
    monkeypatch.setenv("PAGED_JAX_KERNEL_CACHE", str(tmp_path))
    compiler = cpu_paged._compiler()
    path = cpu_paged.build(compiler)
    assert path.parent == tmp_path and path.exists()
    stamp = path.stat().st_mtime_ns
    assert cpu_paged.build(compiler) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    tokens_log2=st.integers(4, 6),
    seqs_log2=st.integers(3, 4),
    page_size=st.sampled_from([8, 16, 32]),
    heads=st.sampled_from([(1, 1), (4, 1), (4, 4), (8, 2), (9, 3)]),
    window=st.sampled_from([None, 5]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_cpu_hypothesis(seed, tokens_log2, seqs_log2, page_size, heads, window, dtype):
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
    check_case(case, "cpu", dtype, sliding_window=window)


def test_engine_step_reads_pages_in_place(tiny_config, tiny_params):
    """The compiled CPU step of the engine (the tiny model, a decode bucket) calls the kernel once per layer on
    the donated page arrays themselves: no copy of a page array anywhere in the optimized HLO."""
    from paged_jax.runner import PagedMeta, step_functions
    from pallas_kernels.common import kv_pages_shape

    c = tiny_config
    _, forward = step_functions(c, "auto")
    pages = jax.ShapeDtypeStruct(kv_pages_shape(64, c.num_kv_heads, 16, c.head_dim), jnp.dtype(c.dtype))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    meta = PagedMeta(i32(16), i32(16), i32(16, 8), i32(17), i32(1))
    hlo = forward.lower(tiny_params, (pages,) * c.num_layers, i32(16), i32(16), meta, i32(16)).compile().as_text()
    assert hlo.count('custom_call_target="paged_jax_paged_attention"') == c.num_layers
    page_type = f"{jnp.dtype(c.dtype).name.replace('float', 'f')}[{','.join(map(str, pages.shape))}]"
    copies = [line for line in hlo.splitlines() if page_type in line.split("=")[0] and " copy(" in line]
    assert sum(page_type in line.split("=")[0] for line in hlo.splitlines()) >= c.num_layers  # the type matches
    assert not copies, copies


@pytest.mark.timeout(300, method="thread")  # a deadlock blocks in C++, where the signal method never fires
def test_independent_calls_in_one_computation_do_not_deadlock():
    """XLA runs independent custom calls of one computation at once on its pool threads; each call hands items
    to the same pool, so a call must never wait for a task queued behind another call (it did: a jitted loop
    over 30 layers' independent attention calls hung). Thirty independent decode calls in one jit finish, exact."""
    seqs = [(1, 30 + 7 * s) for s in range(16)]
    cases = [make_case(20 + i, seqs, num_tokens=16, max_seqs=16, **SHAPE) for i in range(30)]
    f = jax.jit(lambda args: [ragged_paged_attention(*a, sm_scale=0.125, backend="cpu") for a in args])
    outs = f([c.paged_args for c in cases])
    for c, out in zip(cases, outs, strict=True):
        assert_close(out, dense_reference_attention(*c.dense_args, sm_scale=0.125), jnp.float32)
