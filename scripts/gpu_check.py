"""The prepared device check of paged-jax on an NVIDIA GPU (made for an H200): <= 6 minutes, ``--quick`` <= 2.

    PYTHONPATH=. python3 -u scripts/gpu_check.py --out "$OUT"            # on the GPU machine (no .venv needed)
    PYTHONPATH=. python3 -u scripts/gpu_check.py --out "$OUT" --quick    # the first cases of each group only
    python scripts/gpu_check.py --dry-run                                # plan every case, run none (any machine)

Every case is isolated: an exception is recorded as that case's result and the run goes on. Each result is
appended to ``$OUT/gpu_check.jsonl`` as soon as it is measured (a run cut short keeps what it measured), and a
table is printed at the end. Cases, in order (cheapest and most decisive first):

- ``target``: the real device's ``target_config`` written to ``$OUT/target_config.txtpb`` (to replace the
  hand-written ``pallas_kernels/analysis/h200.txtpb`` of the deviceless compile check), device kind and memory.
- ``bandwidth``: a device-to-device copy of 4 GiB (read + write counted).
- ``correct/*``: every backend (``pallas-gpu``: the Triton kernel; ``xla``: the plain-XLA path) against the
  dense reference on random mixed batches with NaN-poisoned pages: decode, chunked prefill, split-KV, GQA/MQA,
  head_dim 64/128/256, page sizes, bf16/f32 and int8/fp8 pages, sliding window, soft cap.
- ``decode/*``: decode bandwidth (% of the measured copy bandwidth, and of 4.8 TB/s) at batch 1/8/64,
  context 1k-32k, head_dim 64/128, bf16/int8/fp8 pages, beside XLA's dense attention on contiguous KV (ratio),
  and one int8 page array over 2 GiB (the 64-bit offset case: checked against the reference on its last pages).
- ``prefill/*``: chunked prefill TFLOP/s (useful FLOPs) beside dense attention.
- ``sweep/*``: a block-config sweep (q rows x KV keys x warps x stages) for the tuning table's decode and
  prefill entries; the best configs go to ``$OUT/tuned_block_configs.json``.
- ``engine/*``: the engine end to end with random Llama-3.1-8B weights initialised on the device: TTFT, TPOT
  and output tok/s at batch 1/32/128.

Every timing row carries the work model's estimate (``pallas_kernels.gpu.plan.gpu_work``) for its plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dense_reference_attention, kv_quant
from pallas_kernels.common import kv_pages_shape
from pallas_kernels.gpu.plan import gpu_plan_for
from pallas_kernels.gpu.tuned_block_sizes import TUNED_BLOCK_CONFIGS
from pallas_kernels.gpu.work_model import gpu_work_detail
from pallas_kernels.work_model import HARDWARE

PEAK_BW = HARDWARE["h200"].hbm_bytes_per_s


@dataclasses.dataclass(frozen=True)
class Case:
    """One isolated measurement: ``run(ctx)`` returns its result fields; ``plan()`` (no device) what it will do."""

    name: str
    quick: bool
    run: Callable[[dict], dict]
    plan: Callable[[], dict] = lambda: {}


# -- helpers ------------------------------------------------------------------------------------------------


def _median_us(fn, *args, iters: int = 20) -> float:
    from pallas_kernels.testing import median_seconds

    return median_seconds(fn, *args, iters=iters) * 1e6


def _decode_batch(batch: int, qh: int, kvh: int, d: int, ctx: int, page: int, kv_dtype: str, extra_pages: int = 0):
    """Random decode inputs: pages in a random physical order, every table full; K/V also contiguous."""
    kq, kk, kv_key = jax.random.split(jax.random.key(0), 3)
    per_seq = ctx // page
    num_pages = batch * per_seq + 1 + extra_pages
    perm = jax.random.permutation(jax.random.key(1), num_pages - 1)[: batch * per_seq] + 1
    tables = perm.reshape(batch, per_seq).astype(jnp.int32)
    k = jax.random.normal(kk, (batch, ctx, kvh, d), jnp.bfloat16)
    v = jax.random.normal(kv_key, (batch, ctx, kvh, d), jnp.bfloat16)
    rows = jnp.concatenate([k, v], axis=-1).reshape(batch, per_seq, page, kvh, 2 * d).transpose(0, 1, 3, 2, 4)
    pages = jnp.zeros(kv_pages_shape(num_pages, kvh, page, d), jnp.bfloat16).at[tables].set(rows)
    if kv_quant.is_quantized_dtype(jnp.dtype(kv_dtype)):
        pages = kv_quant.quantize_pages(pages, jnp.dtype(kv_dtype))
        k, v = (x.astype(jnp.bfloat16) for x in _dequantized_kv(pages, tables, d))
    q = jax.random.normal(kq, (batch, qh, d), jnp.bfloat16)
    lens = jnp.full((batch,), ctx, jnp.int32)
    return q, pages, lens, tables, jnp.arange(batch + 1, dtype=jnp.int32), jnp.array([batch], jnp.int32), k, v


def _dequantized_kv(pages, tables, d):
    """Contiguous float32 K and V ``[B, ctx, H, d]`` of the pages the tables name (gathered, then dequantized)."""
    b, per_seq = tables.shape
    flat = tables.reshape(-1)
    full = kv_quant.dequantize_pages(kv_quant.QuantizedPages(pages.pages[flat], pages.scales[flat]))
    h, page = full.shape[1], full.shape[2]
    full = full.reshape(b, per_seq, h, page, 2 * d)
    full = full.transpose(0, 1, 3, 2, 4).reshape(b, per_seq * page, h, 2 * d)
    return full[..., :d], full[..., d:]


def _model(q_shape, kv_shape, tables_shape, kv_dtype, lens, cu, n, **overrides) -> dict:
    plan = gpu_plan_for(q_shape, kv_shape, tables_shape[0], tables_shape[1], kv_dtype, jnp.bfloat16, **overrides)
    detail = gpu_work_detail(plan, np.asarray(lens), np.asarray(cu), int(np.asarray(n)[0]))
    work = detail["work"]
    return {
        "model_us": work.seconds(HARDWARE["h200"]) * 1e6,
        "model_kv_bytes": work.kv_bytes_read,
        "plan": "; ".join(f"{r.name}: rows {r.rows}, kv {r.kv_block}, splits {r.num_splits}" for r in plan.ranges),
    }


# -- cases --------------------------------------------------------------------------------------------------


def _target(ctx: dict) -> dict:
    from jax._src.lib import _jax

    dev = jax.devices()[0]
    text = _jax.get_topology_for_devices(jax.devices()).target_config
    path = ctx["out"] / "target_config.txtpb"
    path.write_text(str(text))
    stats = dev.memory_stats() or {}
    return {"device": dev.device_kind, "bytes_limit": stats.get("bytes_limit"), "target_config": str(path)}


def _bandwidth(ctx: dict) -> dict:
    x = jnp.ones((1 << 30,), jnp.float32)
    us = _median_us(jax.jit(lambda a: a + 0), x, iters=10)
    ctx["bandwidth"] = 2 * x.nbytes / (us * 1e-6)
    return {"bytes_per_s": ctx["bandwidth"], "pct_of_peak": 100 * ctx["bandwidth"] / PEAK_BW}


CORRECT = [  # (seed, q dtype, kv dtype, q heads, kv heads, head_dim, page, window, cap, tokens, max_seqs, max_kv)
    (0, "float32", None, 8, 2, 128, 16, None, None, 64, 8, 80),
    (1, "bfloat16", None, 32, 8, 128, 16, None, None, 64, 16, 200),
    (2, "bfloat16", None, 8, 1, 64, 8, None, None, 32, 8, 60),
    (3, "float32", None, 8, 8, 256, 32, 20, None, 32, 8, 100),
    (4, "bfloat16", None, 16, 2, 64, 64, None, 30.0, 64, 8, 150),
    (5, "bfloat16", None, 4, 4, 128, 128, 64, 20.0, 32, 8, 300),
    (6, "bfloat16", None, 14, 2, 64, 16, None, None, 16, 8, 3000),  # GQA 7, long: adaptive splits
    (7, "bfloat16", None, 32, 8, 128, 64, 1000, 30.0, 8, 8, 5000),
    (8, "bfloat16", "int8", 32, 8, 128, 16, None, None, 64, 16, 400),
    (9, "bfloat16", "float8_e4m3fn", 9, 3, 64, 16, None, None, 64, 8, 300),
]


def _correct(spec, backend: str) -> Callable[[dict], dict]:
    def run(ctx: dict) -> dict:
        from pallas_kernels.testing import check_case, make_case, random_seqs

        seed, dt, kv_dt, qh, kvh, d, page, window, cap, tokens, max_seqs, max_kv = spec
        seqs = random_seqs(np.random.default_rng(seed), tokens, max_seqs, max_kv)
        case = make_case(
            seed,
            seqs,
            num_tokens=tokens,
            max_seqs=max_seqs,
            num_q_heads=qh,
            num_kv_heads=kvh,
            head_dim=d,
            page_size=page,
            dtype=jnp.dtype(dt),
            kv_dtype=None if kv_dt is None else jnp.dtype(kv_dt),
        )
        check_case(case, backend, jnp.dtype(dt), sliding_window=window, soft_cap=cap)
        return {"seqs": len(seqs)}

    return run


DECODE = [  # (batch, q heads, kv heads, head_dim, context, page, kv dtype)
    (64, 32, 8, 128, 4096, 16, "bfloat16"),
    (8, 32, 8, 128, 16384, 16, "bfloat16"),
    (1, 32, 8, 128, 32768, 16, "bfloat16"),
    (64, 32, 8, 128, 1024, 16, "bfloat16"),
    (64, 32, 8, 64, 4096, 16, "bfloat16"),
    (64, 32, 8, 128, 4096, 64, "bfloat16"),
    (64, 32, 8, 128, 4096, 16, "int8"),
    (64, 32, 8, 128, 4096, 16, "float8_e4m3fn"),
    (8, 14, 2, 64, 32768, 16, "int8"),
]


def _decode(shape) -> Callable[[dict], dict]:
    def run(ctx: dict) -> dict:
        from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu
        from pallas_kernels.testing import assert_close

        b, qh, kvh, d, ctx_len, page, kv_dtype = shape
        q, pages, lens, tables, cu, n, k, v = _decode_batch(b, qh, kvh, d, ctx_len, page, kv_dtype)
        ours = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5))
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, scale=d**-0.5)[:, 0])
        assert_close(ours(q, pages, lens, tables, cu, n), dense(q, k, v), jnp.bfloat16)
        us = _median_us(ours, q, pages, lens, tables, cu, n)
        dense_us = _median_us(dense, q, k, v)
        kv_bytes = b * ctx_len * kvh * kv_quant.bytes_per_token_head(d, jnp.dtype(kv_dtype))
        bw = ctx.get("bandwidth", PEAK_BW)
        values, _ = kv_quant.split(pages)
        model = _model(q.shape, values.shape, tables.shape, values.dtype, lens, cu, n)
        return {
            "us": us,
            "pct_measured_bw": 100 * kv_bytes / (us * 1e-6) / bw,
            "pct_peak_bw": 100 * kv_bytes / (us * 1e-6) / PEAK_BW,
            "dense_us": dense_us,
            "ratio_to_dense": us / dense_us,
            **model,
        }

    return run


def _big_int8(ctx: dict) -> dict:
    """An int8 page array over 2^31 elements (2.1 GiB): the last pages must be read from the right place."""
    from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu

    kvh, d, page = 8, 128, 16
    per_page = kvh * page * 2 * d
    num_pages = (2**31 + 64 * 2**20) // per_page + 1
    rng = jax.random.key(3)
    ka, kb = jax.random.split(rng)
    values = jax.random.randint(ka, kv_pages_shape(num_pages, kvh, page, d), -127, 128, jnp.int32).astype(jnp.int8)
    scales = jax.random.uniform(kb, kv_quant.scales_shape(num_pages, kvh, page), jnp.float32, 0.005, 0.02)
    pages = kv_quant.QuantizedPages(values, scales)
    b, ctx_len = 4, 4096
    tables = (num_pages - 1 - jnp.arange(b * ctx_len // page, dtype=jnp.int32)).reshape(b, -1)  # the top pages
    q = jax.random.normal(jax.random.key(4), (b, 32, d), jnp.bfloat16)
    lens, cu, n = jnp.full((b,), ctx_len, jnp.int32), jnp.arange(b + 1, dtype=jnp.int32), jnp.array([b], jnp.int32)
    out = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5))(q, pages, lens, tables, cu, n)
    k, v = _dequantized_kv(pages, tables, d)
    ref = dense_reference_attention(q, k.astype(jnp.float32), v.astype(jnp.float32), lens, cu, n, sm_scale=d**-0.5)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    if not err < 5e-2:
        raise AssertionError(f"max abs error {err} on pages past element 2^31")
    return {"elements": values.size, "max_abs_err": err}


def _prefill(ctx: dict) -> dict:
    from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu
    from pallas_kernels.testing import assert_close

    s, new, ctx_len, qh, kvh, d, page = 8, 512, 4096, 32, 8, 128, 16
    _, pages, lens, tables, _, n, k, v = _decode_batch(s, qh, kvh, d, ctx_len, page, "bfloat16")
    q = jax.random.normal(jax.random.key(5), (s * new, qh, d), jnp.bfloat16)
    cu = jnp.arange(s + 1, dtype=jnp.int32) * new
    ours = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5))
    q_pos = ctx_len - new + jnp.arange(new)
    mask = (jnp.arange(ctx_len)[None, :] <= q_pos[:, None])[None, None]
    dense = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(q.reshape(s, new, qh, d), k, v, mask=mask, scale=d**-0.5).reshape(
            s * new, qh, d
        )
    )
    assert_close(ours(q, pages, lens, tables, cu, n), dense(q, k, v), jnp.bfloat16)
    us, dense_us = _median_us(ours, q, pages, lens, tables, cu, n), _median_us(dense, q, k, v)
    model = _model(q.shape, pages.shape, tables.shape, pages.dtype, lens, cu, n)
    useful = 4 * s * qh * d * int(np.sum(q_pos + 1))
    return {
        "us": us,
        "tflops": useful / (us * 1e-6) / 1e12,
        "dense_us": dense_us,
        "ratio_to_dense": us / dense_us,
        **model,
    }


SWEEP_CONFIGS = [(keys, warps, stages) for keys in (32, 64, 128) for warps in (4, 8) for stages in (2, 3, 4)]


def _sweep(ctx: dict) -> dict:
    """Decode configs (KV keys x warps x stages) of the (128, 16, bf16) table entry, best written to $OUT."""
    from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu

    b, qh, kvh, d, ctx_len, page, kv_dtype = 64, 32, 8, 128, 4096, 16, "bfloat16"
    q, pages, lens, tables, cu, n, _, _ = _decode_batch(b, qh, kvh, d, ctx_len, page, kv_dtype)
    results = []
    for keys, warps, stages in SWEEP_CONFIGS:
        cfg = {"kv_keys": keys, "warps": warps, "stages": stages}
        fn = jax.jit(
            functools.partial(
                ragged_paged_attention_gpu,
                sm_scale=d**-0.5,
                pages_per_block=keys // page,
                num_warps=warps,
                num_stages=stages,
            )
        )
        try:
            results.append({**cfg, "us": _median_us(fn, q, pages, lens, tables, cu, n, iters=10)})
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            results.append({**cfg, "error": type(e).__name__})
    ok = [r for r in results if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    (ctx["out"] / "tuned_block_configs.json").write_text(
        json.dumps({"(128, 16, 'bfloat16') decode": best, "all": results}, indent=1)
    )
    current = TUNED_BLOCK_CONFIGS[(128, 16, "bfloat16")][0]
    return {"best": best, "table": dataclasses.asdict(current), "configs": len(results)}


def _engine(batch: int) -> Callable[[dict], dict]:
    def run(ctx: dict) -> dict:
        from paged_jax import LLM, SamplingParams

        llm = ctx.get("llm")
        if llm is None:
            llm = ctx["llm"] = LLM(model="llama-3.1-8b", max_num_seqs=128, max_model_len=2048)
        prompts = [{"prompt_token_ids": list(range(1000 + i, 1512 + i))} for i in range(batch)]
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], params, use_tqdm=False)  # compile the buckets this batch uses
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft = [o.metrics.time_to_first_token for o in outs]
        tpot = [o.metrics.time_per_output_token for o in outs]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "ttft_ms": 1e3 * float(np.median(ttft)),
            "tpot_ms": 1e3 * float(np.median([t for t in tpot if t is not None])),
            "tok_per_s": tokens / wall,
        }

    return run


def _big_int8_plan() -> dict:
    elements = ((2**31 + 64 * 2**20) // (8 * 16 * 256) + 1) * 8 * 16 * 256
    assert elements > 2**31
    return {"elements": elements}


def _prefill_plan() -> dict:
    s, new, ctx_len = 8, 512, 4096
    lens, cu, n = np.full(s, ctx_len), np.arange(s + 1) * new, np.array([s])
    return _model((s * new, 32, 128), kv_pages_shape(s * 256 + 1, 8, 16, 128), (s, 256), "bfloat16", lens, cu, n)


def _engine_plan() -> dict:
    from paged_jax import SamplingParams
    from paged_jax.config import load_model_config

    config = load_model_config("llama-3.1-8b")
    SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    return {"layers": config.num_layers, "prompt_tokens": 512, "max_tokens": 128}


def cases() -> list[Case]:
    """Every case, in run order."""
    out = [Case("target", True, _target), Case("bandwidth", True, _bandwidth)]
    for i, spec in enumerate(CORRECT):
        for backend in ("pallas-gpu", "xla"):
            out.append(Case(f"correct/{backend}/{i}", i < 3, _correct(spec, backend), lambda s=spec: {"spec": s}))
    for i, shape in enumerate(DECODE):
        b, qh, kvh, d, ctx_len, page, kv_dtype = shape

        def plan(shape=shape):
            b, qh, kvh, d, ctx_len, page, kv_dtype = shape
            lens, cu, n = np.full(b, ctx_len), np.arange(b + 1), np.array([b])
            num_pages = b * ctx_len // page + 1
            return _model(
                (b, qh, d), kv_pages_shape(num_pages, kvh, page, d), (b, ctx_len // page), kv_dtype, lens, cu, n
            )

        out.append(Case(f"decode/b{b}-ctx{ctx_len}-d{d}-page{page}-{kv_dtype}", i < 2, _decode(shape), plan))
    out.append(Case("decode/int8-over-2GiB", True, _big_int8, _big_int8_plan))
    out.append(Case("prefill/8x512-ctx4096", True, _prefill, _prefill_plan))
    out.append(Case("sweep/decode-128-16-bf16", False, _sweep, lambda: {"configs": len(SWEEP_CONFIGS)}))
    for batch in (1, 32, 128):
        out.append(Case(f"engine/llama-3.1-8b-random-b{batch}", batch == 1, _engine(batch), _engine_plan))
    return out


def _jsonable(x):
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/gpu_check"))
    parser.add_argument("--quick", action="store_true", help="the first cases of each group (<= 2 minutes)")
    parser.add_argument("--dry-run", action="store_true", help="plan every case (shapes, work model), run none")
    parser.add_argument("--only", nargs="*", default=None, metavar="PREFIX", help="cases whose name starts so")
    args = parser.parse_args(argv)
    selected = [c for c in cases() if (c.quick or not args.quick)]
    if args.only is not None:
        selected = [c for c in selected if any(c.name.startswith(p) for p in args.only)]
    if args.dry_run:
        for c in selected:
            print(f"plan {c.name}: {json.dumps({k: _jsonable(v) for k, v in c.plan().items()})}")
        print(f"{len(selected)} case(s) planned")
        return 0
    if jax.default_backend() != "gpu":
        print(f"no GPU here (backend {jax.default_backend()}): use --dry-run")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "gpu_check.jsonl"
    ctx: dict = {"out": args.out}
    rows = []
    t_all = time.perf_counter()
    for c in selected:
        t0 = time.perf_counter()
        try:
            result, status = c.run(ctx), "ok"
        except Exception as e:  # noqa: BLE001 - one case's failure is its result; the run goes on
            result, status = (
                {"error": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc(limit=4)},
                "FAIL",
            )
        row = {"case": c.name, "status": status, "seconds": round(time.perf_counter() - t0, 2), **result}
        with log.open("a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        print(
            f"{status:<5}{c.name:<48}{row['seconds']:>7.1f}s  "
            + ", ".join(f"{k}={_jsonable(v)}" for k, v in result.items() if k != "trace")[:300],
            flush=True,
        )
        rows.append(row)
    print(f"\n{'case':<48}{'status':>7}{'us':>10}{'% bw':>7}{'model us':>10}{'vs dense':>9}")
    for r in rows:
        us, pct, model, dense = (r.get(k) for k in ("us", "pct_measured_bw", "model_us", "ratio_to_dense"))
        fmt = lambda x, f: f"{x:{f}}" if isinstance(x, (int, float)) else "-"
        cols = fmt(us, "10.1f") + fmt(pct, "7.1f") + fmt(model, "10.1f") + fmt(dense, "9.2f")
        print(f"{r['case']:<48}{r['status']:>7}{cols}")
    failed = sum(r["status"] != "ok" for r in rows)
    print(f"{failed} failure(s), {time.perf_counter() - t_all:.0f}s; results in {log}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
