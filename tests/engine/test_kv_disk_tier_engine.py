"""The disk tier end to end: an engine computes a long shared prefix and stops; a second engine over the same
directory (a restart) answers a request on that prefix without recomputing it, with the tokens of an engine
that computes it cold. A damaged file is skipped (recomputed, same tokens), an engine of other weights reads none
of the blocks, and an unwritable directory leaves the engine serving."""

from __future__ import annotations

import numpy as np

from paged_jax.model.init import init_params
from paged_jax.sampling_params import SamplingParams

from support.engines import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PS = 16


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def generate(engine, tokens: list[int]) -> tuple[list[int], int]:
    """The request's tokens, and the prompt tokens the engine computed for it."""
    before = engine.runner.real_tokens
    rid = f"r{engine.num_steps}"
    engine.add_request(rid, tokens, GREEDY)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                out = list(o.outputs[0].token_ids)
    engine.check_invariants()
    assert out is not None
    return out, engine.runner.real_tokens - before - (GREEDY.max_tokens - 1)


def warm(tmp_path, config, params, shared: list[int]) -> None:
    """A first engine computes `shared` (+ a tail); every block it computed is written behind."""
    first = make_engine(config, params, kv_disk_cache_dir=str(tmp_path))
    generate(first, shared + prompt(9, 5))
    first.host_tier.disk.flush()  # the engine went idle: its last blocks were handed to the writer
    assert first.stats().kv_disk_writes >= len(shared) // PS


def test_a_restart_serves_a_long_prefix_from_disk(tmp_path, tiny_config, tiny_params):
    shared = prompt(0, 12 * PS)
    warm(tmp_path, tiny_config, tiny_params, shared)
    request = shared + prompt(1, 7)
    cold, computed_cold = generate(make_engine(tiny_config, tiny_params), request)
    restarted = make_engine(tiny_config, tiny_params, kv_disk_cache_dir=str(tmp_path))
    out, computed = generate(restarted, request)
    assert out == cold
    assert computed_cold == len(request) and computed == len(request) - len(shared)
    st = restarted.stats()
    assert st.kv_disk_hits == len(shared) // PS and st.prefix_hits == len(shared) and st.kv_disk_rejected == 0
    assert st.pages_in_use == 0


def test_damaged_files_and_other_weights_are_never_used(tmp_path, tiny_config, tiny_params):
    shared = prompt(2, 6 * PS)
    warm(tmp_path, tiny_config, tiny_params, shared)
    request = shared + prompt(3, 4)
    cold, _ = generate(make_engine(tiny_config, tiny_params), request)
    other = make_engine(tiny_config, init_params(tiny_config, seed=1), kv_disk_cache_dir=str(tmp_path))
    _, computed = generate(other, request)
    assert computed == len(request) and other.stats().kv_disk_hits == 0  # another fingerprint: nothing read
    files = sorted(p for d in tmp_path.iterdir() for p in d.iterdir())
    for path in files:  # damage every block file: each flips one byte in the middle
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0xFF]) + raw[len(raw) // 2 + 1 :])
    restarted = make_engine(tiny_config, tiny_params, kv_disk_cache_dir=str(tmp_path))
    out, computed = generate(restarted, request)
    assert out == cold and computed == len(request)
    assert restarted.stats().kv_disk_rejected >= 1 and restarted.stats().kv_disk_hits == 0


def test_an_unwritable_directory_keeps_serving(tmp_path, tiny_config, tiny_params):
    blocked = tmp_path / "file"
    blocked.write_text("")
    engine = make_engine(tiny_config, tiny_params, kv_disk_cache_dir=str(blocked))
    request = prompt(4, 4 * PS + 3)
    cold, _ = generate(make_engine(tiny_config, tiny_params), request)
    out, _ = generate(engine, request)
    generate(engine, prompt(5, 9))
    engine.host_tier.disk.flush()
    assert out == cold and engine.stats().kv_disk_write_errors > 0
