"""The C++ CPU kernel (pallas_kernels.cpu.paged): its ISA paths, work items (prefill blocks, split key ranges),
quantized pages, NaN edges, the backend choice on CPU, the build cache, the compiled step, concurrency. The
semantic cases (batches, GQA, windows, soft caps, head dims, long contexts, hypothesis) run on the XLA path and
on every ISA path of the kernel in test_attention_xla.py.

Every case poisons the slots a correct kernel never reads (NaN: null page, unused pages, slots past kv_len,
padding queries), so reading one fails the comparison."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dense_reference_attention, kv_quant, ragged_paged_attention, resolve_backend
from pallas_kernels.cpu import paged as cpu_paged
from pallas_kernels.testing import assert_close, check_case, cpu_kernel_path, make_case

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="the CPU kernel needs a C++ compiler (g++)")

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
# The machine's best path and the AVX2 baseline (where this CPU has it), and the portable one.
PATHS = [
    pytest.param(isa, marks=pytest.mark.skipif(not cpu_paged.available(isa), reason=f"no {isa} path here"))
    for isa in cpu_paged.ISA_FLAGS
]


def test_each_path_is_built_for_its_instruction_set():
    """native follows the CPU (AVX-512 with vdpbf16ps where it has AVX-512 BF16), the forced paths are what they
    say, and each is its own library and FFI target."""
    flags = set(cpu_paged.cpu_flags().split())
    expect = "avx512+bf16" if "avx512_bf16" in flags else "avx512" if "avx512f" in flags else None
    expect = expect or ("avx2" if {"avx2", "fma"} <= flags else "generic")
    assert cpu_paged.kernel("native").isa == expect
    assert cpu_paged.kernel("generic").isa == "generic"
    built = [cpu_paged.kernel(i) for i in cpu_paged.ISA_FLAGS if cpu_paged.available(i)]
    if cpu_paged.available("avx2"):
        assert cpu_paged.kernel("avx2").isa == "avx2"
    assert len({k.library for k in built}) == len({k.target for k in built}) == len(built)


@pytest.mark.parametrize("isa", PATHS)
def test_exp_nonpositive_accuracy_and_edges(isa):
    """The kernel's exp: within 4 ulp of exp on [-87, 0]; exactly 0 below -87 and at -inf; NaN stays NaN."""
    lib = ctypes.CDLL(str(cpu_paged.kernel(isa).library))
    grid = -np.concatenate([np.linspace(0, 87, 20_001), np.geomspace(1e-8, 1e-1, 200)]).astype(np.float32)
    edges = np.array([-87.01, -88.0, -100.0, -1e30, -np.inf, np.nan], np.float32)
    x = np.concatenate([grid, edges])
    y = np.empty_like(x)
    ptr = ctypes.POINTER(ctypes.c_float)
    lib.PagedAttentionExp(x.ctypes.data_as(ptr), y.ctypes.data_as(ptr), ctypes.c_int64(x.size))
    exact = np.exp(grid.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(y[: grid.size] - exact) / ulp) <= 4
    np.testing.assert_array_equal(y[grid.size : -1], 0.0)
    assert np.isnan(y[-1])


@pytest.mark.parametrize("isa", PATHS)
def test_nan_query_makes_only_its_own_row_nan(isa):
    """A NaN in a real query (decode and prefill items) makes that row NaN (never a plausible number, and never
    its neighbours' rows); every other row stays exact."""
    case = make_case(11, [(1, 40), (20, 45), (1, 3)], num_tokens=32, max_seqs=4, **SHAPE)
    poisoned = [(0, 1), (5, 2), (20, 3)]  # (token, query head): decode token 0, prefill tokens 5 and 20
    q = case.q
    for t, h in poisoned:
        q = q.at[t, h, 7].set(jnp.nan)
    args = (q, *case.paged_args[1:])
    out = np.asarray(cpu_kernel_path(isa)(*args, sm_scale=0.125))
    ref = np.asarray(dense_reference_attention(q, *case.dense_args[1:], sm_scale=0.125))
    bad = np.zeros(out.shape[:2], bool)
    for t, h in poisoned:
        bad[t, h] = True
    assert np.all(np.isnan(out[bad]))
    real = int(case.cu_q_lens[3])
    keep = ~bad[:real]
    np.testing.assert_allclose(out[:real][keep], ref[:real][keep], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("kv", [1100, 2049, 5000])
@pytest.mark.parametrize("window", [None, 1500])
def test_long_single_sequence_splits_keys_across_threads(isa, kv, window):
    """Batch 1 with one KV head is one work item: its keys are cut into parts (on machines with more than one
    thread) whose softmax states are merged; every split, with and without a window, is exact."""
    case = make_case(12, [(1, kv)], num_tokens=8, max_seqs=2, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    check_case(case, cpu_kernel_path(isa), sliding_window=window)


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


MIXED = [(1, 40), (0, 0), (30, 30), (40, 70), (1, 1), (6, 20)]  # decode, empty, prefill, chunked over 2 items


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window,cap", [(None, None), (5, 30.0)])
def test_quantized_pages(isa, kv_dtype, dtype, window, cap):
    """int8 / e4m3 pages with their per-row scales (NaN scales in every poisoned slot) against the reference on
    the dequantized K/V (the XLA path's dequantization: pallas_kernels.testing.make_case)."""
    case = make_case(8, MIXED, num_tokens=128, max_seqs=8, dtype=dtype, kv_dtype=kv_dtype, **SHAPE)
    check_case(case, cpu_kernel_path(isa), dtype, sliding_window=window, soft_cap=cap)


def test_quantized_pages_take_the_kernel():
    """backend 'cpu' (and 'auto') sends quantized pages to the kernel's quantized target."""
    case = make_case(8, [(1, 20), (5, 9)], num_tokens=16, max_seqs=8, kv_dtype=jnp.int8, **SHAPE)
    f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, backend="cpu"))
    assert "paged_jax_paged_attention_quantized" in f.lower(*case.paged_args).as_text()
    check_case(case, "cpu")


def test_library_is_cached_per_source_cpu_and_path(tmp_path, monkeypatch):
    """The build lands in the cache under a key of sources, compiler, flags, jaxlib and CPU flags; a second build
    finds it and compiles nothing; another CPU (other flags) or another path never gets this library."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGED_JAX_KERNEL_CACHE", str(cache))
    # The cache's mechanics on a one-line translation unit (the kernel's own build takes tens of seconds; every
    # other test here builds and runs it through the same function).
    source = tmp_path / "paged_attention.cc"
    source.write_text('extern "C" int PagedAttentionProbe() { return 1; }\n')
    monkeypatch.setattr(cpu_paged, "SOURCES", (source,))
    compiler = cpu_paged.compiler()
    path = cpu_paged.build(compiler, "generic")
    assert path.parent == cache and path.exists()
    stamp = path.stat().st_mtime_ns
    assert cpu_paged.build(compiler, "generic") == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary left behind
    assert ctypes.CDLL(str(path)).PagedAttentionProbe() == 1
    source.write_text('extern "C" int PagedAttentionProbe() { return 2; }\n')  # edited sources: a new key
    assert cpu_paged.library_path(compiler, "generic") != path
    assert len({cpu_paged.library_path(compiler, isa) for isa in cpu_paged.ISA_FLAGS}) == len(cpu_paged.ISA_FLAGS)
    monkeypatch.setattr(cpu_paged, "cpu_flags", lambda: "flags : fpu sse sse2 avx2 fma")
    assert cpu_paged.library_path(compiler, "generic") != path


def test_a_saved_build_loads_under_its_own_target():
    """cpu_paged.load registers any build of the kernel (bench_kernels' --baseline: an older commit's library)
    under targets of its own; called through them it is the same library, exact, quantized pages included."""
    native = cpu_paged.kernel("native")
    saved = cpu_paged.load(native.library, "paged_jax_test_saved")
    assert (saved.target, saved.quantized_target) == ("paged_jax_test_saved", "paged_jax_test_saved_quantized")
    assert saved.isa == native.isa and saved.library == native.library

    def saved_path(q, kv, *rest, **opts):
        pages, scales = kv_quant.split(kv)
        return cpu_paged.call(saved, q, pages, *rest, kv_scales=scales, **opts)

    for kv_dtype in (None, jnp.int8):
        case = make_case(13, [(1, 40), (6, 20)], num_tokens=16, max_seqs=4, kv_dtype=kv_dtype, **SHAPE)
        out = saved_path(*case.paged_args, sm_scale=0.125)
        np.testing.assert_array_equal(out, cpu_kernel_path("native")(*case.paged_args, sm_scale=0.125))
        check_case(case, saved_path)


def test_isa_env_var_is_validated(monkeypatch):
    monkeypatch.setenv(cpu_paged.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="PAGED_JAX_CPU_ISA"):
        cpu_paged.default_isa()


def test_engine_step_reads_pages_in_place(tiny_config, tiny_params):
    """The compiled CPU step of the engine (the tiny model, a decode bucket) calls the kernel once per layer on
    the donated page arrays themselves: no copy of a page array anywhere in the optimized HLO."""
    from paged_jax.worker.paged_attention import PagedMeta
    from paged_jax.worker.step_functions import StepKey, step_functions
    from pallas_kernels.common import kv_pages_shape

    c = tiny_config
    _, forward = step_functions(StepKey(c, "auto"))
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
