"""Tensor and data parallelism on 8 CPU devices, and the batch script over two real JAX processes.

The mesh tests need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts, so under a
plain `pytest tests` the test `test_mesh_suite` re-runs this file in a child pytest with the flag set
(and `PAGED_JAX_MESH_CHILD=1`, which defines the mesh tests instead of the driver). Run the mesh tests
alone with: `PAGED_JAX_MESH_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
pytest tests/worker/test_sharding.py`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paged_jax.config import ModelConfig
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.data_parallel import LeastLoadedRouter
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.offline.batch import run_batch

from support.mesh_child import CHILD, NUM_DEVICES, run_mesh_child

main_only = pytest.mark.skipif(CHILD, reason="runs in the parent process")


def small_config(num_kv_heads: int) -> ModelConfig:
    """hidden 256, 8 query heads of 32, vocab 320 (the byte tokenizer's ids fit): divisible by TP 1..8."""
    return ModelConfig(
        name=f"kv{num_kv_heads}",
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        max_position_embeddings=1024,
        eos_token_ids=(2,),
    )


def make_prompts(n: int, seed: int, max_len: int = 70, shared_prefix: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 259, shared_prefix).tolist()
    return [prefix + rng.integers(3, 259, int(rng.integers(1, max_len))).tolist() for _ in range(n)]


# -- checks that need one device (run in the main process) ---------------------------------------------------
@main_only
def test_expanded_kv_heads_compute_the_same_function():
    import jax.numpy as jnp

    from paged_jax.model.attention import DenseMeta
    from paged_jax.model.init import init_params
    from paged_jax.model.llama import LlamaForCausalLM
    from paged_jax.worker.sharding import expand_kv_heads, kv_replication

    config = small_config(2)
    params = init_params(config, seed=3)
    assert kv_replication(config, 8) == 4 and kv_replication(config, 2) == 1
    big_config, big = expand_kv_heads(config, params, 4)
    assert big_config.num_kv_heads == 8
    assert big["params"]["layers_0"]["self_attn"]["qkv_proj"].shape == (256, 8, 1 + 2, 32)  # G = 8 / 8 = 1
    tokens = jnp.asarray(make_prompts(1, seed=5, max_len=40)[0], jnp.int32)
    meta = DenseMeta.single(len(tokens))

    def logits(cfg, p):
        model = LlamaForCausalLM(cfg)
        hidden, _ = model.apply(p, tokens, meta.positions, None, meta)
        return np.asarray(model.apply(p, hidden, method=LlamaForCausalLM.compute_logits))

    np.testing.assert_allclose(logits(big_config, big), logits(config, params), rtol=1e-5, atol=1e-5)


@main_only
def test_tp_degrees_that_cannot_split_the_model_are_rejected():
    from paged_jax.worker.sharding import dp_device_groups, kv_replication

    with pytest.raises(ValueError, match="num_heads"):
        kv_replication(small_config(2), 16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_replication(
            ModelConfig(
                vocab_size=320, hidden_size=192, intermediate_size=384, num_heads=12, num_kv_heads=3, head_dim=16
            ),
            2,
        )
    with pytest.raises(ValueError, match="devices"):
        dp_device_groups(2, 2, devices=["d0", "d1", "d2"])
    assert dp_device_groups(2, 2, devices=list("abcd")) == [["a", "b"], ["c", "d"]]


@main_only
def test_router_sends_each_request_to_the_least_loaded_replica():
    router = LeastLoadedRouter(3)
    picks = []
    for rid, n in [("a", 2), ("b", 1), ("c", 1), ("d", 1)]:
        i = router.pick()
        router.assign(rid, i, n)
        picks.append(i)
    assert picks == [0, 1, 2, 1] and router.load == [2, 2, 1]
    assert router.release("a") == 0 and router.load == [0, 2, 1] and router.pick() == 0
    assert router.release("a") is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def batch_cmd(inp: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "paged_jax.offline.batch",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--model",
        "tiny",
        "--attention-backend",
        "xla",
        "--no-warmup",
        "--num-pages",
        "96",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
        "--no-progress",
    ]


def comparable(path: Path) -> dict[str, tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = {r["id"]: (r["text"], r["token_ids"], r["finish_reason"]) for r in rows}
    assert len(out) == len(rows), "duplicate ids in the output"
    return out


@pytest.mark.slow  # a fresh process (start-up and compiles)
@main_only
def test_batch_over_two_processes_matches_one(tmp_path):
    """Two real processes (jax.distributed over gloo on localhost) each take half the lines; process 0
    merges their parts into one output equal to a single process's; a re-run adds nothing."""
    lines = [
        json.dumps(
            {
                "id": f"q{i}",
                "prompt": f"request {i} " * (1 + i % 4),
                "max_tokens": 4 + i % 5,
                "temperature": 0.0 if i % 3 else 0.7,
                "seed": i,
                "ignore_eos": True,
            }
        )
        for i in range(9)
    ]
    lines.insert(4, "{broken")
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PAGED_JAX_COMPILE_CACHE": "off"}
    env.pop("XLA_FLAGS", None)
    single = tmp_path / "single" / "out.jsonl"
    config, params, tokenizer = load_model("tiny")  # what `--model tiny` loads, in this process
    engine = LLMEngine(
        config,
        params,
        tokenizer,
        # the auto attention backend, as the CLI processes use
        EngineConfig(num_pages=96, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="auto", warmup=False),
    )
    run_batch(engine, inp, single, progress=False)
    multi = tmp_path / "multi" / "out.jsonl"
    addr = f"localhost:{free_port()}"

    def run_two() -> list[str]:
        procs = [
            subprocess.Popen(
                batch_cmd(inp, multi) + ["--coordinator-address", addr, "--num-processes", "2", "--process-id", str(i)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        logs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
        return logs

    logs = run_two()
    assert "merged 2 parts" in logs[0]
    assert comparable(multi) == comparable(single)
    assert len(comparable(multi)) == 9
    parts = sorted(p.name for p in multi.parent.iterdir() if ".part-" in p.name and "errors" not in p.name)
    assert parts == ["out.part-00000-of-00002.jsonl", "out.part-00001-of-00002.jsonl"]
    errors = (multi.parent / "out.errors.jsonl").read_text().splitlines()
    assert len(errors) == 1 and json.loads(errors[0])["line"] == 5
    before = multi.read_bytes()
    run_two()  # every id is already done: the output must not change
    assert multi.read_bytes() == before
    assert (multi.parent / "out.errors.jsonl").read_text().splitlines() == errors


if not CHILD:

    @pytest.mark.mesh
    def test_mesh_suite():
        """The mesh tests below, in a child pytest with 8 host devices."""
        run_mesh_child(__file__)

else:
    import jax

    from paged_jax.engine.data_parallel import DataParallelEngine
    from paged_jax.model.init import init_params
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.tokenization.tokenizer import ByteTokenizer
    from paged_jax.worker.paged_attention import PagedMeta
    from paged_jax.worker.sampler import sample

    CONFIGS = {kv: small_config(kv) for kv in (8, 2)}
    PARAMS = {kv: init_params(cfg, seed=kv) for kv, cfg in CONFIGS.items()}
    OPTIONS = {
        "num_pages": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "attention_backend": "xla",
        "warmup": False,
    }

    def make_engine(kv: int, **options) -> LLMEngine | DataParallelEngine:
        ec = EngineConfig(**(OPTIONS | options))
        cls = DataParallelEngine if ec.data_parallel_size > 1 else LLMEngine
        return cls(CONFIGS[kv], PARAMS[kv], ByteTokenizer(), ec)

    def serve(engine, requests: list[tuple[list[int], SamplingParams]], arrive_every: int = 1) -> dict:
        """Feed requests one per `arrive_every` steps; returns id -> (token ids per choice, logprobs)."""
        pending, results, step = list(enumerate(requests)), {}, 0
        while pending or engine.has_unfinished():
            if pending and step % arrive_every == 0:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(f"r{i}", prompt, params)
            for out in engine.step():
                if out.finished:
                    lps = [[lp.logprob for lp in c.logprobs or []] for c in out.outputs]
                    results[out.request_id] = ([c.token_ids for c in out.outputs], lps)
            step += 1
        for replica in getattr(engine, "replicas", [engine]):
            check_manager_invariants(replica.kv)
            assert replica.kv.stats().pages_in_use == 0
        return results

    def prefill_logits(engine: LLMEngine, prompt: list[int]) -> np.ndarray:
        """Logits [8, V] of positions 0..7 of one sequence, straight from the jitted step (pages 1..)."""
        runner = engine.runner
        t, s, n, ps = 64, 8, len(prompt), runner.page_size
        tokens, positions, slots = np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32)
        tokens[:n], positions[:n], slots[:n] = prompt, np.arange(n), np.arange(n) + ps
        tables = np.zeros((s, runner.max_blocks), np.int32)
        tables[0, : -(-n // ps)] = np.arange(1, 1 + -(-n // ps))
        kv_lens, cu = np.zeros(s, np.int32), np.full(s + 1, n, np.int32)
        kv_lens[0], cu[0] = n, 0
        meta = PagedMeta(slots, kv_lens, tables, cu, np.array([1], np.int32))
        logits, runner.kv_caches, _ = runner._forward(
            runner.params, runner.kv_caches, tokens, positions, meta, np.arange(s, dtype=np.int32), None
        )
        return np.asarray(logits)

    GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)

    @pytest.fixture(scope="module")
    def single_device() -> dict:
        """Per config: (greedy results, prefill logits) of the plain single-device engine."""
        out = {}
        prompt = make_prompts(1, seed=9, max_len=60)[0] + [7] * 8
        for kv in CONFIGS:
            engine = make_engine(kv, scan_layers="off")
            logits = prefill_logits(engine, prompt)
            out[kv] = (serve(engine, [(p, GREEDY) for p in make_prompts(6, seed=kv)]), logits, prompt)
        return out

    def test_eight_devices():
        assert jax.device_count() == NUM_DEVICES

    TP_CASES = [(kv, tp, "on") for kv in (8, 2) for tp in (1, 2, 4, 8)] + [(8, 4, "off"), (2, 4, "off")]

    @pytest.mark.parametrize("kv, tp, scan", TP_CASES, ids=[f"kv{k}-tp{t}-scan_{s}" for k, t, s in TP_CASES])
    def test_tensor_parallel_matches_single_device(single_device, kv, tp, scan):
        """TP engines (scanned, as "auto" runs them on TPU and GPU; also unrolled at TP 4) against the unrolled
        single device."""
        engine = make_engine(kv, tensor_parallel_size=tp, scan_layers=scan)
        assert engine.runner.scan == (scan != "off")
        if tp > 1:
            pages = jax.tree.leaves(engine.runner.kv_caches)[0]  # layer 0's pages, or the stacked ones
            assert pages.sharding.spec[1] == "tp" and len(pages.sharding.device_set) == tp
            local = pages.addressable_shards[0].data.shape[1]
            assert local == max(1, kv // tp)  # each chip holds K and V of its own (or replicated) heads
        want_results, want_logits, prompt = single_device[kv]
        np.testing.assert_allclose(prefill_logits(engine, prompt), want_logits, rtol=2e-5, atol=2e-5)
        got = serve(engine, [(p, GREEDY) for p in make_prompts(6, seed=kv)])
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want_results.items()}
        for rid, (_, lps) in got.items():
            np.testing.assert_allclose(lps, want_results[rid][1], rtol=1e-4, atol=1e-4)

    def mixed_workload() -> list[tuple[list[int], SamplingParams]]:
        prompts = make_prompts(8, seed=21) + make_prompts(4, seed=22, max_len=20, shared_prefix=40)
        kinds = [
            SamplingParams(temperature=0.0, max_tokens=12),
            SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=9),
            SamplingParams(temperature=1.0, top_k=20, n=2, seed=11, max_tokens=7),
            SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[100, 101], logprobs=2),
        ]
        return [(p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]

    def test_dp2_tp2_serves_a_mixed_workload_like_one_device():
        want = serve(make_engine(2), mixed_workload())
        dp = make_engine(2, tensor_parallel_size=2, data_parallel_size=2)
        groups = [sorted(d.id for d in r.mesh.devices.flat) for r in dp.replicas]
        assert groups == [[0, 1], [2, 3]]
        got = serve(dp, mixed_workload())
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
        assert all(r.num_steps > 0 for r in dp.replicas)  # both replicas served
        stats = dp.stats()
        assert stats.pages_in_use == 0 and len(stats.replicas) == 2

    def test_prompt_logprobs_and_logit_bias_with_tp():
        """Prompt logprobs (in chunks, through the vocab-sharded LM head) and logit bias on a TP group equal one
        device's."""
        prompt = make_prompts(1, seed=40, max_len=60)[0] + list(range(20, 60))
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3, logit_bias={11: 9.0})

        def run(engine) -> tuple[list[int], list]:
            engine.add_request("r", prompt, params)
            while engine.has_unfinished():
                for out in engine.step():
                    final = out
            assert engine.kv.stats().pages_in_use == 0
            return final.outputs[0].token_ids, final.prompt_logprobs

        want_tokens, want = run(make_engine(2, chunk_size=32))
        got_tokens, got = run(make_engine(2, tensor_parallel_size=4, chunk_size=32))
        assert got_tokens == want_tokens and len(got) == len(want) == len(prompt) and got[0] is None
        for a, b in zip(got[1:], want[1:], strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose(
                [a.logprob, *(v for _, v in a.top)], [b.logprob, *(v for _, v in b.top)], atol=1e-4
            )

    def test_kv_tiers_with_tp_give_the_cold_tokens():
        """The host tier (evicted prefix blocks restored) and swap on preemption on a TP 2 group, whose pages are
        sharded over KV heads: the same requests' tokens as computed cold on the same group, every page and host
        slot back at the end."""
        work = [(p, GREEDY) for p in make_prompts(6, seed=50, max_len=30, shared_prefix=48) * 2]
        cold = serve(make_engine(2, tensor_parallel_size=2, enable_prefix_caching=False), work)
        options = {"num_pages": 12, "kv_host_cache_gib": 0.01, "kv_preemption_mode": "swap"}
        engine = make_engine(2, tensor_parallel_size=2, **options)
        got = serve(engine, work)
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in cold.items()}
        for rid, (_, lps) in got.items():
            np.testing.assert_allclose(lps, cold[rid][1], rtol=1e-4, atol=1e-4)
        st = engine.stats()
        assert st.kv_host_hits > 0 and st.kv_host_swap_outs == st.kv_host_swap_ins > 0
        assert st.kv_host_swap_pages_held == 0
        engine.check_invariants()

    def test_no_recompilation_in_steady_state_with_tp():
        engine = make_engine(2, tensor_parallel_size=4, warmup=True, num_pages=12)
        forward = engine.runner._forward  # the step the engine runs (scanned or not)
        compiled = (forward._cache_size(), sample._cache_size(), engine.runner.compile_stats.count)
        work = [
            (p, SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, logprobs=lp))
            for p, t, m, lp in zip(
                make_prompts(12, seed=30, max_len=100), [0.0, 0.7] * 6, [3, 20, 9] * 4, [None, None, 2] * 4, strict=True
            )
        ]
        serve(engine, work, arrive_every=1)
        assert engine.stats().num_preemptions > 0  # a tight cache: preemption and recompute too
        assert (forward._cache_size(), sample._cache_size(), engine.runner.compile_stats.count) == compiled
        assert engine.runner.warm and engine.stats().compiles_after_warmup == 0
