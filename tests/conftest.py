"""Shared fixtures: the embedded tiny config and its random parameters (built once per session), the release
of each test module's compiled executables, the `side` marker on the modules `make test` runs in its second
stream, the XLA:CPU optimisation level of the test processes, and no compile cache unless a test asks for one."""

from __future__ import annotations

import gc
import lzma
import os
import shutil
from collections.abc import Callable
from pathlib import Path

# The suite compiles thousands of small executables and runs each a few times, so most of its time is XLA:CPU
# compiling. Its LLVM backend at -O0 builds the same programs (XLA's HLO passes and fusion decisions do not
# depend on the level, and no level enables fast math) in about a quarter less time. Set before JAX starts its
# CPU client; child processes (the CLI, the mesh suites) inherit it. A level given in $XLA_FLAGS is kept.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# The Python API keeps compiled executables in the user's cache by default (`paged_jax.engine.compile_cache`).
# Tests start without it, so that what one test compiles or counts never depends on what an earlier run (or an
# earlier test) left on disk; a test that exercises the cache points the variable at its own directory.
os.environ.setdefault("PAGED_JAX_COMPILE_CACHE", "off")


import jax  # noqa: E402
import pytest  # noqa: E402

from paged_jax.config import ModelConfig, load_model_config  # noqa: E402
from paged_jax.model.init import Params, init_params  # noqa: E402
from paged_jax.worker.kv_transfer import clear_executables  # noqa: E402
from paged_jax.worker.runner import EXECUTABLES  # noqa: E402

# The modules `make test` runs in its second stream, beside the rest of the suite, after the TPU and GPU compile
# checks (with the mesh suites: `pytest -m "mesh or side"`). Chosen by measured durations (`make test` prints the
# slowest tests of both streams) so that the two streams, each about one core's work, end together on 2 cores.
SIDE_MODULES = frozenset(
    {
        "test_lora_smollm2.py",
        "test_smollm2.py",
        "test_stream_unary_smollm2.py",
        "test_multihost_warmup.py",
    }
)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SIDE_MODULES:
            item.add_marker(pytest.mark.side)


MAPS = "/proc/self/maps"
MAX_MAPS = 40_000  # Linux refuses mmap past vm.max_map_count (65,530 by default)


def memory_maps() -> int:
    with open(MAPS) as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True, scope="module")
def release_executables():
    """Drop every compiled executable when a test module ends.

    The runners' shared registry (`EXECUTABLES`) and JAX's compile caches keep each executable alive for the
    life of the process, and each XLA:CPU executable
    holds about nine memory maps of its own. One `pytest tests` process compiles many thousands of them: by
    about two thirds of the suite it passed vm.max_map_count, a code mapping failed and the process died
    with SIGSEGV inside XLA. Clearing the caches per module keeps the count flat; the check makes a leak
    (something else holding executables) a test error that names the module instead of a crash."""
    yield
    EXECUTABLES.clear()
    clear_executables()
    jax.clear_caches()
    gc.collect()
    if os.path.exists(MAPS):
        assert memory_maps() < MAX_MAPS, f"{memory_maps()} memory maps after releasing this module's executables"


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return load_model_config("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny_config: ModelConfig) -> Params:
    return init_params(tiny_config, seed=0)


TOKENIZER_DATA = Path(__file__).resolve().parents[0] / "data" / "tokenizers"


@pytest.fixture(scope="session")
def real_tokenizer_dir(tmp_path_factory) -> Callable[[str], Path]:
    """A model directory holding a real vocabulary (`phi-3` or `gpt-2`) from tests/data/tokenizers (see its README)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            src, out = TOKENIZER_DATA / name, tmp_path_factory.mktemp(f"tok-{name}")
            for path in src.iterdir():
                if path.name == "tokenizer.json.xz":
                    (out / "tokenizer.json").write_bytes(lzma.decompress(path.read_bytes()))
                elif path.suffix in (".json", ".jinja"):
                    shutil.copy(path, out / path.name)
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="module")
def fronts(request):
    """(HTTP front, gRPC front) on the session's shared engine loop (tests/support/serve_support.py), for one test
    module; the tiny byte tokenizer gets the module's `TEMPLATE` as its chat template meanwhile."""
    from paged_jax.tokenization.chat_template import template_from_text
    from serve.config import ServingConfig
    from serve.openai_api.server import HttpServerThread

    from support.serve_support import LIMITS, shared, start_server

    s = shared()
    tokenizer = s.engine.tokenizer
    template = template_from_text(request.module.TEMPLATE, "test template")
    old_template, tokenizer.chat_template = tokenizer.chat_template, template
    grpc_front = start_server()
    http = HttpServerThread(s.loop, ServingConfig(port=0, http_port=0, limits=LIMITS), s.metrics).start()
    yield http, grpc_front
    http.stop()
    grpc_front.stop()
    tokenizer.chat_template = old_template


@pytest.fixture
def oai(fronts):
    """The official `openai` client on the HTTP front; after the test, every request has ended and every page is
    free (checked through gRPC GetStats)."""
    import openai

    from serve.client import Client

    from support.serve_support import wait_idle

    http, grpc_front = fronts
    with openai.OpenAI(base_url=http.base_url, api_key="unused", max_retries=0) as client:
        yield client
    wait_idle(Client(grpc_front.target))
