"""Multi-LoRA serving (paged_jax.lora): PEFT adapters are read or refused clearly, their outputs equal
transformers + peft (tests/data/lora, made by scripts/golden/make_lora_golden.py), and batching adapters together,
swapping them through few device slots, the prefix cache, chunked prefill, preemption, n > 1, int8 weights and
tensor parallelism never change a request's result. Every engine test ends with every page free."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.lora import LoRARequest, delta
from paged_jax.lora import weights as lw
from paged_jax.lora.delta import LoraBatch
from paged_jax.lora.named import ServedAdapters, check_lora_modules, serve_lora_modules
from paged_jax.lora.peft import LoraError, read_adapter
from paged_jax.model.attention import DenseMeta
from paged_jax.model.families import causal_lm
from paged_jax.model.init import init_params
from paged_jax.model.scan import stack_layers
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer

from support.lora_adapters import (
    GREEDY,
    OPTIONS,
    TINY,
    lora_engine,
    make_tiny_adapters,
    merged_params,
    prompts,
    serve,
    write_adapter,
)

DATA = Path(__file__).parents[1] / "data"
LORA = DATA / "lora"
GOLDEN_VARIANTS = ("gqa", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
GOLDEN_ADAPTERS = ("all", "qv_rslora")
ATOL = 1e-4
GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory) -> dict[str, LoRARequest]:
    return make_tiny_adapters(tmp_path_factory.mktemp("adapters"))


# -- loading --------------------------------------------------------------------------------------------------


def test_a_peft_adapter_maps_onto_our_layout():
    config, _, _ = load_model(DATA / "hf_gqa")
    adapter = read_adapter(LORA / "gqa_all", "all", config, max_rank=16)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert adapter.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a, b = adapter.layers[0]["q_proj"]
    assert a.shape == (config.hidden_size, 4) and b.shape == (4, config.num_heads, config.head_dim)
    a, b = adapter.layers[1]["o_proj"]
    assert a.shape == (config.num_heads, config.head_dim, 4) and b.shape == (4, config.hidden_size)
    rs = read_adapter(LORA / "gqa_qv_rslora", "qv", config, max_rank=16)
    assert rs.scaling == pytest.approx(16 / np.sqrt(8)) and rs.target_modules == ("q_proj", "v_proj")
    assert rs.digest != adapter.digest


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text()) | changes
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
BAD_ADAPTERS = {
    "modules_to_save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "dora": (lambda p: _edit_config(p, use_dora=True), "use_dora"),
    "bias": (lambda p: _edit_config(p, bias="all"), "bias"),
    "rank_pattern": (lambda p: _edit_config(p, rank_pattern={"q_proj": 2}), "rank_pattern"),
    "rank over max": (lambda p: _edit_config(p, r=32), "max_lora_rank"),
    "not lora": (lambda p: _edit_config(p, peft_type="IA3"), "peft_type"),
    "unknown target": (lambda p: _edit_config(p, target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    "wrong shape": (
        lambda p: _edit_tensors(p, lambda t: t.update({f"{Q0}.lora_B.weight": np.zeros((7, 4), np.float32)})),
        f"{Q0}.lora_B.weight': shape [7, 4]",
    ),
    "rank mismatch": (
        lambda p: _edit_tensors(p, lambda t: t.update({f"{Q0}.lora_A.weight": np.zeros((3, 256), np.float32)})),
        f"{Q0}.lora_A.weight': shape [3, 256], expected [4, 256]",
    ),
    "missing half": (lambda p: _edit_tensors(p, lambda t: t.pop(f"{Q0}.lora_B.weight")), "lora_B partner is missing"),
    "embedding tensor": (
        lambda p: _edit_tensors(
            p, lambda t: t.update({"base_model.model.model.embed_tokens.lora_A.weight": np.zeros((4, 320), np.float32)})
        ),
        "embed_tokens.lora_A.weight': not a LoRA A/B weight",
    ),
    "layer out of range": (
        lambda p: _edit_tensors(
            p,
            lambda t: t.update(
                {k.replace("layers.0.", "layers.7."): v for k, v in list(t.items()) if "layers.0." in k}
            ),
        ),
        "layer 7, the model has 2",
    ),
    "nan": (
        lambda p: _edit_tensors(p, lambda t: t[f"{Q0}.lora_A.weight"].__setitem__((0, 0), np.nan)),
        "NaN or infinity",
    ),
    "pickle only": (
        lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"),
        "adapter_model.bin is a pickle and is not read",
    ),
    "no config": (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_invalid_adapters_are_refused_naming_the_adapter_and_the_problem(case, tiny_adapters, tmp_path):
    path = Path(shutil.copytree(tiny_adapters["all"].lora_path, tmp_path / "bad"))
    edit, message = BAD_ADAPTERS[case]
    edit(path)
    with pytest.raises(LoraError, match="adapter 'bad'") as err:
        read_adapter(path, "bad", TINY, max_rank=16)
    assert message in str(err.value)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_lora_modules_are_read_at_start_up_and_a_bad_one_stops_it(command, tmp_path, monkeypatch, capsys):
    """`--lora-modules` adapters are checked when the command starts (before warm-up and any request), the error
    naming the flag, the adapter and what is wrong: a missing directory, a rank above --max-lora-rank."""
    from serve.main import main

    monkeypatch.setenv("PAGED_JAX_COMPILE_CACHE", "off")
    good = write_adapter(tmp_path / "good", TINY, rank=4)
    big = write_adapter(tmp_path / "big", TINY, rank=32)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi", "max_tokens": 2}\n')
    argv = {
        "serve": ["serve", "--port", "0", "--grpc-port", "0", "--no-warmup"],
        "generate": ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
    }[command] + ["--model", "tiny", "--dtype", "float32", "--max-lora-rank", "16", "--lora-modules", f"ok={good}"]

    def fails(arg: str) -> str:
        if command == "generate":
            with pytest.raises(SystemExit) as e:
                main([*argv, arg])
            return str(e.value.code)
        assert main([*argv, arg]) == 2  # one line on stderr, exit status 2
        return capsys.readouterr().err

    assert re.search(
        r"--lora-modules gone=.*adapter 'gone': no adapter_config.json", fails(f"gone={tmp_path / 'gone'}")
    )
    assert re.search(r"--lora-modules big=.*adapter 'big'.*32", fails(f"big={big}"))
    assert not (tmp_path / "out.jsonl").exists()


def test_adapters_checked_at_start_up_are_in_the_engines_cache_for_their_first_request(tiny_adapters):
    """A server's `--lora-modules`: the start-up check reads each adapter once and `serve_lora_modules` serves it
    with what was read in the engine's adapter cache, so the first request naming it reads no directory; its
    tokens equal those of an engine that read the adapter for that request."""
    engine = lora_engine()
    modules = [("a", tiny_adapters["all"].lora_path), ("b", tiny_adapters["ok"].lora_path)]
    checked = check_lora_modules(modules, engine.config, engine.engine_config.max_lora_rank)
    served = ServedAdapters()
    serve_lora_modules(served, modules, checked, engine.adapters)
    assert len(engine.adapters) == 2 and engine.adapters.num_reads == 0
    requests = [("r", [5, 6, 7, 8], GREEDY, served.get("a"))]
    got = serve(engine, requests)
    assert engine.adapters.num_reads == 0
    reference = lora_engine()
    assert serve(reference, requests)["r"][0] == got["r"][0] and reference.adapters.num_reads == 1


def test_mlp_adapters_are_refused_on_moe_models():
    config, _, _ = load_model(DATA / "hf_mixtral")
    with pytest.raises(LoraError, match="MLP adapters are not supported on MoE models"):
        read_adapter(LORA / "gqa_all", "all", config.replace(num_layers=2), max_rank=16)


def test_engine_refuses_lora_requests_when_lora_is_off_and_bad_adapters_at_add(tiny_adapters, tmp_path):
    plain = LLMEngine(TINY, init_params(TINY, seed=0), ByteTokenizer(), EngineConfig(**OPTIONS))
    with pytest.raises(ValueError, match="lora_request: LoRA is not enabled"):
        plain.add_request("r", [5, 6], GREEDY, lora_request=tiny_adapters["all"])
    engine = lora_engine()
    with pytest.raises(LoraError, match="adapter 'x': no adapter_config.json"):
        engine.add_request("r", [5, 6], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id"):
        engine.add_request("r", [5, 6], GREEDY, lora_request=LoRARequest("x", 0, str(tmp_path)))
    assert not engine.has_unfinished()


# -- the batched delta ----------------------------------------------------------------------------------------


def test_each_token_gets_its_own_adapters_delta_and_a_step_without_adapters_none():
    """q/k/v, o, gate/up and down deltas of a token batch mixing three slots and slot 0 (random weights, never
    zeros) equal scaling * x @ A @ B of each token's own slot, computed per token and per projection in numpy
    (q's heads, K and V each from its own entries of the grouped arrays); slot 0 adds nothing, the stacked layout
    gives the per-layer one's outputs bit for bit, and a step whose tokens all have slot 0 returns the base
    outputs unchanged (bit for bit)."""
    rng = np.random.default_rng(0)
    cfg = TINY
    lmax, rank, t = 3, 4, 9
    shapes = lw.layer_shapes(cfg, lmax, rank)
    arrays = {k: jnp.asarray(rng.standard_normal(v), jnp.float32) for k, v in shapes.items()}
    scaling = jnp.asarray([0.5, 2.0, 1.5], jnp.float32)
    slots = jnp.asarray([0, 1, 2, 3, 0, 3, 1, 2, 0], jnp.int32)
    h, hq, hkv, d, i = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    g = hq // hkv
    x, out, hid = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((t, h), (t, hq, d), (t, i)))
    y, qkv, gate_up = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((t, h), (t, hkv, g + 2, d), (t, 2, i))
    )

    def deltas(weights: lw.LoraWeights, slots) -> list[jax.Array]:
        layer = LoraBatch(weights, slots).layers().at(0)
        return [
            delta.add_qkv(x, qkv, layer),
            delta.add_o(y, out, layer),
            delta.add_gate_up(x, gate_up, layer),
            delta.add_down(y, hid, layer),
        ]

    per_layer = lw.LoraWeights((arrays,), scaling)  # one layer
    got_qkv, got_o, got_gu, got_down = deltas(per_layer, slots)
    a = {n: np.asarray(w, np.float64) for n, w in arrays.items()}
    for j in range(t):
        s = int(slots[j])
        c = 0.0 if s == 0 else float(scaling[s - 1])  # slot 0: no adapter, no delta
        e = max(s - 1, 0)  # its entry in the arrays (any for slot 0: c is 0)
        xj, oj, hj = (np.asarray(z[j], np.float64) for z in (x, out, hid))
        u = [c * xj @ a["qkv_a"][:, n, e] for n in range(3)]  # q, k, v: [R] each
        want = np.asarray(qkv[j], np.float64).copy()  # [Hkv, G + 2, D]
        want[:, :g] += np.einsum("r,grhd->hgd", u[0], a["qkv_b"][:g, e])  # query head h * G + k at [h, k]
        want[:, g] += np.einsum("r,rhd->hd", u[1], a["qkv_b"][g, e])
        want[:, g + 1] += np.einsum("r,rhd->hd", u[2], a["qkv_b"][g + 1, e])
        np.testing.assert_allclose(np.asarray(got_qkv[j]), want, rtol=1e-4, atol=1e-4)
        ref_o = np.asarray(y[j]) + c * np.tensordot(oj, a["o_a"][..., e, :], 2) @ a["o_b"][e]
        np.testing.assert_allclose(np.asarray(got_o[j]), ref_o, rtol=1e-4, atol=1e-4)
        for n in range(2):  # gate, up
            ref = np.asarray(gate_up[j, n]) + c * (xj @ a["gate_up_a"][:, n, e]) @ a["gate_up_b"][n, e]
            np.testing.assert_allclose(np.asarray(got_gu[j, n]), ref, rtol=1e-4, atol=1e-4)
        ref_d = np.asarray(y[j]) + c * (hj @ a["down_a"][:, e]) @ a["down_b"][e]
        np.testing.assert_allclose(np.asarray(got_down[j]), ref_d, rtol=1e-4, atol=1e-4)
    stacked = lw.LoraWeights({k: w[None] for k, w in arrays.items()}, scaling)
    for got, want in zip(deltas(stacked, slots), (got_qkv, got_o, got_gu, got_down), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    none = jnp.zeros(t, jnp.int32)
    assert not bool(LoraBatch(per_layer, none).layers().active)
    for got, base in zip(deltas(per_layer, none), (qkv, y, gate_up, y), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(base))


# -- against transformers + peft ------------------------------------------------------------------------------


def _golden(directory: Path) -> list[dict[str, np.ndarray]]:
    data = np.load(directory / "golden.npz")
    count = len([k for k in data.files if k.startswith("prompt_")])
    return [{k.rsplit("_", 1)[0]: data[k] for k in data.files if k.endswith(f"_{i}")} for i in range(count)]


def one_slot_lora(config, adapter, tokens: int, stacked: bool, max_rank: int = 8) -> LoraBatch:
    """A LoraBatch of two adapter slots (slot 1 = `adapter`) whose `tokens` tokens all run slot 1, its arrays
    stacked or per layer (`paged_jax.lora.weights`)."""
    weights = lw.allocate(config, 2, max_rank, stacked)
    layers, scaling = lw.slot_arrays(adapter, config, max_rank, stacked)
    weights = lw.write_slot(weights, jnp.int32(1), layers, scaling)
    return LoraBatch(weights, jnp.ones(tokens, jnp.int32))


def _peft_logits(variant: str, adapter: str, scan: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The golden prompts of `variant`_`adapter` packed through the dense model with the adapter in slot 1 and
    without it (`scan`: the scanned decoder over stacked weights and stacked LoRA slots): (logits, base logits,
    transformers + peft's logits), each [sum n, V]."""
    config, params, _ = load_model(DATA / f"hf_{variant}", dtype="float32")
    params = stack_layers(params) if scan else params
    lora = read_adapter(LORA / f"{variant}_{adapter}", adapter, config, max_rank=8)
    golden = _golden(LORA / f"{variant}_{adapter}")
    tokens = jnp.asarray(np.concatenate([g["prompt"] for g in golden]), jnp.int32)
    positions = np.concatenate([np.arange(len(g["prompt"])) for g in golden])
    segments = np.concatenate([np.full(len(g["prompt"]), i) for i, g in enumerate(golden)])
    meta = DenseMeta(segment_ids=jnp.asarray(segments, jnp.int32), positions=jnp.asarray(positions, jnp.int32))
    model = causal_lm(config, scan_layers=scan)
    out = []
    for batch in (one_slot_lora(config, lora, len(tokens), stacked=scan), None):
        hidden, _ = model.apply(params, tokens, meta.positions, None, meta, batch)
        out.append(np.asarray(model.apply(params, hidden, method="compute_logits")))
    return out[0], out[1], np.concatenate([g["logits"] for g in golden])


@pytest.mark.parametrize("adapter", GOLDEN_ADAPTERS)
@pytest.mark.parametrize("variant", GOLDEN_VARIANTS)
def test_logits_match_transformers_peft(variant, adapter):
    logits, base, want = _peft_logits(variant, adapter)
    assert np.abs(base - want).max() > 0.1  # the adapter changes the logits: the golden is no base-model one
    err = np.abs(logits - want).max()
    print(f"{variant}_{adapter}: max |logit - transformers+peft| = {err:.2e}")
    assert err < ATOL, f"{variant}_{adapter}: {err}"


@pytest.mark.parametrize("variant", ["gqa", "gemma3", "qwen3_moe"])
def test_scanned_lora_matches_transformers_peft_and_the_unrolled_one(variant):
    """Stacked LoRA slots [L, ...] scanned with the layers (Gemma 3: in its window groups; MoE: attention
    adapters only) give peft's logits and the unrolled decoder's within float32 rounding."""
    logits, _, want = _peft_logits(variant, "all", scan=True)
    assert np.abs(logits - want).max() < ATOL
    np.testing.assert_allclose(logits, _peft_logits(variant, "all")[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", GOLDEN_VARIANTS)
def test_one_batch_of_two_adapters_and_the_base_model_matches_transformers_peft(variant):
    """Every golden prompt with each adapter and with none, all in the same steps of the scanned engine: each
    request's greedy tokens are peft's (and the base model's those of tests/data/hf_<variant>)."""
    config, params, tokenizer = load_model(DATA / f"hf_{variant}", dtype="float32")
    options = OPTIONS | {"enable_lora": True, "max_loras": 2, "scan_layers": "on"}
    engine = LLMEngine(config, params, tokenizer, EngineConfig(**options))
    assert engine.runner.scan
    want, requests = {}, []
    for j, name in enumerate(GOLDEN_ADAPTERS):
        lora = LoRARequest(name, j + 1, str(LORA / f"{variant}_{name}"))
        for i, g in enumerate(_golden(LORA / f"{variant}_{name}")):
            requests.append((f"{name}{i}", g["prompt"].tolist(), GREEDY16, lora))
            want[f"{name}{i}"] = g["greedy"].tolist()
    for i, g in enumerate(_golden(DATA / f"hf_{variant}")):
        requests.append((f"base{i}", g["prompt"].tolist(), GREEDY16, None))
        want[f"base{i}"] = g["greedy"].tolist()
    got = serve(engine, requests)
    assert {k: v[0][0] for k, v in got.items()} == want


# -- batching, swapping, caching: each request gets exactly what it gets alone -------------------------------------


def _solo(requests: list[tuple], **options) -> dict:
    """Each request alone on a fresh engine of the same options (same executables)."""
    out = {}
    for r in requests:
        out |= serve(lora_engine(**options), [r])
    return out


def _same(got: dict, want: dict) -> None:
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    for k in want:
        np.testing.assert_allclose(np.array(got[k][1]), np.array(want[k][1]), rtol=1e-5, atol=1e-5)


def test_a_mixed_batch_gives_each_request_its_solo_result(tiny_adapters):
    a, b = tiny_adapters["all"], tiny_adapters["qv"]
    ps = prompts(6, seed=1)
    requests = [(f"r{i}", p, GREEDY, (a, b, None)[i % 3]) for i, p in enumerate(ps)]
    mixed = serve(lora_engine(), requests)
    _same(mixed, _solo(requests))
    # and the adapters matter: the same prompt differs under A, B and none
    same_prompt = [(f"s{i}", ps[0], GREEDY, lora) for i, lora in enumerate((a, b, None))]
    outs = [v[0][0] for v in serve(lora_engine(), same_prompt).values()]
    assert len({tuple(o) for o in outs}) == 3


def test_lora_equals_the_merged_weights(tiny_adapters):
    """A request with an adapter gets the tokens of the base model with W + scaling * A @ B merged in, from the
    scanned engine (adapter slots stacked [L, ...]) and from the unrolled one (the last adapter)."""
    params = init_params(TINY, seed=0)
    ps = prompts(3, seed=2)
    for name, scan in (("all", "on"), ("qv", "on"), ("mlp", "off")):
        lora = tiny_adapters[name]
        adapter = read_adapter(lora.lora_path, name, TINY, max_rank=8)
        merged = LLMEngine(TINY, merged_params(params, TINY, adapter), ByteTokenizer(), EngineConfig(**OPTIONS))
        want = serve(merged, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(ps)])
        engine = lora_engine(params=params, scan_layers=scan)
        assert engine.runner.scan == (scan == "on")
        got = serve(engine, [(f"r{i}", p, GREEDY, lora) for i, p in enumerate(ps)])
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}, name
        for k in want:
            np.testing.assert_allclose(np.array(got[k][1]), np.array(want[k][1]), rtol=1e-4, atol=1e-4)


def test_more_adapters_than_slots_swap_exactly_and_never_recompile(tiny_adapters):
    """Four adapters through two device slots over time (LRU swapping, requests waiting for a slot while both
    are busy): every request equals its solo run, and no step compiles anything after warm-up."""
    loras = list(tiny_adapters.values())
    ps = prompts(12, seed=3)
    requests = [(f"r{i}", p, GREEDY, loras[i % 4] if i % 5 else None) for i, p in enumerate(ps)]
    engine = lora_engine(warmup=True, max_num_batched_tokens=32, max_cpu_loras=2)
    got = serve(engine, requests, arrive_every=2)
    stats = engine.runner.compile_stats
    assert stats.after_warmup == 0, stats
    assert engine.scheduler.lora_slots.num_loads > 2  # adapters were swapped in and out of the two slots
    assert engine.adapters.num_reads > 4  # and out of the two-adapter host cache, then read again
    _same(got, _solo(requests, max_num_batched_tokens=32))


def test_the_prefix_cache_never_serves_one_adapters_kv_to_another(tiny_adapters):
    a, b = tiny_adapters["all"], tiny_adapters["qv"]
    prompt = prompts(1, seed=4, lo=50, hi=51)[0]
    engine = lora_engine()
    order = [("a1", a), ("b1", b), ("n1", None), ("a2", a), ("b2", b), ("n2", None)]
    got = {}
    for rid, lora in order:  # one after another, so each can only hit what the earlier ones cached
        got |= serve(engine, [(rid, prompt, GREEDY, lora)])
    cached = {rid: got[rid][2].num_cached_prompt_tokens for rid, _ in order}
    assert cached == {"a1": 0, "b1": 0, "n1": 0, "a2": 48, "b2": 48, "n2": 48}
    for x in "abn":
        assert got[f"{x}1"][0] == got[f"{x}2"][0]
    _same({k: got[k] for k in ("a1", "b1", "n1")}, _solo([(rid, prompt, GREEDY, lora) for rid, lora in order[:3]]))


def test_chunked_prefill_preemption_n_and_lookahead_keep_each_result(tiny_adapters):
    a, b = tiny_adapters["all"], tiny_adapters["mlp"]
    ps = prompts(6, seed=5, lo=20, hi=60)
    sampled = SamplingParams(temperature=0.9, top_k=20, n=2, seed=7, max_tokens=8, logprobs=1)
    requests = [(f"r{i}", p, (GREEDY, sampled)[i % 2], (a, b, None)[i % 3]) for i, p in enumerate(ps)]
    want = _solo(requests)
    for options in (
        {"chunk_size": 16},
        {"num_pages": 14, "max_num_seqs": 6},  # few pages: preemption
        {"async_scheduling": False},
    ):
        engine = lora_engine(**options)
        _same(serve(engine, requests), want)
        if "num_pages" in options:
            assert engine.scheduler.num_preemptions > 0


def test_int8_base_weights(tiny_adapters):
    config, params, _ = load_model("tiny", quantization="int8")
    a = tiny_adapters["all"]
    ps = prompts(4, seed=6)
    requests = [(f"r{i}", p, GREEDY, (a, None)[i % 2]) for i, p in enumerate(ps)]
    mixed = serve(lora_engine(config, params), requests)
    solo = {}
    for r in requests:
        solo |= serve(lora_engine(config, params), [r])
    _same(mixed, solo)
    base = serve(lora_engine(config, params), [("x", ps[0], GREEDY, None)])
    assert base["x"][0] != mixed["r0"][0]


# -- offline fronts ----------------------------------------------------------------------------------------------


def test_llm_generate_takes_a_lora_request_per_prompt(tiny_adapters):
    from paged_jax.offline.llm import LLM

    a = tiny_adapters["all"]
    ps = prompts(2, seed=9)
    llm = LLM("tiny", enable_lora=True, max_loras=2, max_lora_rank=8, **(OPTIONS | {"num_pages": 32}))
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False, lora_request=[a, None])
    want = serve(lora_engine(), [("x", ps[0], GREEDY, a), ("y", ps[1], GREEDY, None)])
    assert [o.outputs[0].token_ids for o in outs] == [want["x"][0][0], want["y"][0][0]]
    with pytest.raises(ValueError, match="lora_request: need one per prompt"):
        llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False, lora_request=[a])


def test_batch_lines_name_their_adapter(tiny_adapters, tmp_path):
    from paged_jax.lora.named import ServedAdapters
    from paged_jax.offline.batch import run_batch

    a = tiny_adapters["all"]
    p = prompts(1, seed=10)[0]
    lines = [
        {"id": 1, "prompt_token_ids": p, "lora": "a", "max_tokens": 10, "temperature": 0.0},
        {"id": 2, "prompt_token_ids": p, "max_tokens": 10, "temperature": 0.0},
        {"id": 3, "prompt_token_ids": p, "lora": "nope", "max_tokens": 10},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_batch(
        lora_engine(),
        tmp_path / "in.jsonl",
        tmp_path / "out.jsonl",
        progress=False,
        adapters=ServedAdapters([("a", a.lora_path)]),
    )
    assert summary.requests == 2 and summary.errors == 1
    got = {x["id"]: x["token_ids"] for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    want = serve(lora_engine(), [("1", p, GREEDY, a), ("2", p, GREEDY, None)])
    assert got == {1: want["1"][0][0], 2: want["2"][0][0]}
    error = json.loads((tmp_path / "out.errors.jsonl").read_text())
    assert error["id"] == 3 and error["error"].startswith("lora: the LoRA adapter 'nope' is not served here")
