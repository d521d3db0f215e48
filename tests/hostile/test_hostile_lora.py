"""Hostile adapters and names at /v1/load_lora_adapter and --lora-modules (issue 41): every refusal is an
OpenAI-shaped 4xx naming `lora_path` or `lora_name` (never a plain-text 500), a name being served or loaded is a
409 (of concurrent loads of one new name exactly one succeeds), weights linked from outside the adapter
directory and huge weights are refused, loads and unloads are logged, and start-up errors are one line."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged_jax.errors import UsageError
from paged_jax.lora.named import check_lora_modules, parse_lora_modules
from paged_jax.lora.random_adapter import write_adapter
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.openai_api.server import HttpServerThread

from support.lora_adapters import TINY, lora_engine

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("good") / "a", TINY, rank=4, seed=1)


@pytest.fixture(scope="module")
def http():
    loop = EngineLoop(lora_engine()).start()
    server = HttpServerThread(loop, ServingConfig(port=0, http_port=0, enable_lora_runtime_updates=True)).start()
    yield server
    server.stop()
    loop.stop()


def post(http, route: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{http.base_url}/{route}", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())  # a plain-text 500 would fail here


def _copy(good: Path, to: Path) -> Path:
    shutil.copytree(good, to)
    return to


def _config_bytes(data: bytes):
    return lambda d: (d / CONFIG).write_bytes(data)


def _config_with(**fields):
    def edit(d: Path) -> None:
        cfg = json.loads((d / CONFIG).read_text())
        (d / CONFIG).write_text(json.dumps(cfg | fields))

    return edit


def _huge_weight(d: Path) -> None:
    tensors = load_file(str(d / WEIGHTS))
    key = sorted(tensors)[0]
    tensors[key] = np.full_like(tensors[key], 3e38)
    save_file(tensors, str(d / WEIGHTS))


def _weights_linked_outside(d: Path) -> None:
    outside = d.parent / f"{d.name}-elsewhere.safetensors"
    (d / WEIGHTS).rename(outside)
    (d / WEIGHTS).symlink_to(outside)


BAD_ADAPTERS = {  # name: (how the good adapter is spoiled, words of the 400's message)
    "config-not-utf8": (_config_bytes(b'{"r": 4, "peft_type": "LORA", "x": "\xff\xfe"}'), "not UTF-8"),
    "config-nested": (_config_bytes(b'{"r": 4, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"), "nested deeper"),
    "config-digits": (_config_bytes(b'{"r": ' + b"7" * 5000 + b"}"), "adapter_config.json.r"),
    "target-modules-integers": (_config_with(target_modules=[1, 2]), "target_modules: must be a list of module"),
    "target-modules-integer": (_config_with(target_modules=7), "target_modules: must be"),
    "huge-alpha": (_config_with(lora_alpha=1e30), "lora_alpha: a scaling of"),
    "huge-weights": (_huge_weight, "more than 10000 in magnitude"),
    "weights-linked-outside": (_weights_linked_outside, "outside the model directory"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_bad_adapters_are_a_400_naming_lora_path(http, good, tmp_path, case):
    spoil, words = BAD_ADAPTERS[case]
    path = _copy(good, tmp_path / case)
    spoil(path)
    code, body = post(http, "load_lora_adapter", {"lora_name": case, "lora_path": str(path)})
    assert code == 400 and body["error"]["param"] == "lora_path", body
    assert words in body["error"]["message"] and body["error"]["type"] == "invalid_request_error", body
    code, body = post(http, "load_lora_adapter", {"lora_name": case, "lora_path": str(good)})  # name released
    assert code == 200, body
    assert post(http, "unload_lora_adapter", {"lora_name": case})[0] == 200


@pytest.mark.parametrize("name", ["a\nb", "../x", "a b", "x" * 100_000, "", ".hidden", "a/b/c", 7])
def test_unsafe_names_are_a_400_naming_lora_name(http, good, name):
    code, body = post(http, "load_lora_adapter", {"lora_name": name, "lora_path": str(good)})
    assert code == 400 and body["error"]["param"] == "lora_name", body
    assert len(body["error"]["message"]) < 300


def test_taken_names_are_a_409_and_concurrent_loads_of_one_name_succeed_once(http, good, caplog):
    assert post(http, "load_lora_adapter", {"lora_name": "org/taken", "lora_path": str(good)})[0] == 200
    for name in ("org/taken", TINY.name):
        code, body = post(http, "load_lora_adapter", {"lora_name": name, "lora_path": str(good)})
        assert code == 409 and body["error"]["type"] == "conflict_error" and body["error"]["param"] == "lora_name"
    codes: list[int] = []
    start = threading.Barrier(6)

    def load() -> None:
        start.wait()
        codes.append(post(http, "load_lora_adapter", {"lora_name": "fresh", "lora_path": str(good)})[0])

    with caplog.at_level(logging.INFO, logger="paged_jax.lora.named"):
        threads = [threading.Thread(target=load) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [200] + [409] * 5, codes
        for name in ("org/taken", "fresh"):
            assert post(http, "unload_lora_adapter", {"lora_name": name})[0] == 200
    logged = [r.getMessage() for r in caplog.records]
    assert any("'fresh' served from" in m for m in logged) and any("'fresh' unloaded" in m for m in logged)


def test_lora_modules_errors_are_one_line(good, tmp_path):
    path = _copy(good, tmp_path / "bad")
    _config_bytes(b"\xff")(path)
    with pytest.raises(UsageError) as e:
        check_lora_modules([("bad", str(path))], TINY, 8)
    assert str(e.value).startswith("--lora-modules bad=") and "not UTF-8" in str(e.value) and "\n" not in str(e.value)
    for spec in ("a b=/x", "../up=/x", "n\nl=/x"):
        with pytest.raises(UsageError, match="^--lora-modules: .*not a servable name"):
            parse_lora_modules([spec])
