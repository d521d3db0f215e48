"""The C++ CPU kernel (pallas_kernels.cpu_paged): its work items, the backend choice on CPU, the build cache,
the compiled step, concurrency. The semantic cases (batches, GQA, windows, soft caps, head dims, long
contexts, hypothesis) run on both CPU paths in test_attention_xla.py.

Every case poisons the slots a correct kernel never reads (NaN: null page, unused pages, slots past kv_len,
padding queries), so reading one fails the comparison."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import cpu_paged, dense_reference_attention, ragged_paged_attention, resolve_backend
from pallas_kernels.testing import assert_close, check_case, make_case

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="the CPU kernel needs a C++ compiler (g++)")

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)


def test_cpu_long_prompt_spans_several_work_items():
    """A 70-token prompt is cut into blocks of 32 query tokens per work item; every block sees the right keys."""
    case = make_case(9, [(70, 75), (1, 3)], num_tokens=128, max_seqs=4, **SHAPE)
    check_case(case, "cpu")


def test_auto_backend_on_cpu_is_the_kernel_and_runs_under_jit():
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("auto", "tpu") == "pallas-tpu" and resolve_backend("auto", "gpu") == "pallas-gpu"
    with pytest.raises(ValueError, match="backend='cpu' is the CPU kernel"):
        resolve_backend("cpu", "gpu")
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


def test_engine_step_reads_pages_in_place(tiny_config, tiny_params):
    """The compiled CPU step of the engine (the tiny model, a decode bucket) calls the kernel once per layer on
    the donated page arrays themselves: no copy of a page array anywhere in the optimized HLO."""
    from paged_jax.worker.runner import PagedMeta, step_functions
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
