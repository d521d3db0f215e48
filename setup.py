"""Which packages the paged-jax distribution installs, and under which names (the metadata is pyproject.toml's).

A checkout keeps `serve/` and `configs/` beside `paged_jax/` (`python -m serve`, `configs/<name>.json`); a
wheel installs them inside the distribution's own namespace, as `paged_jax.serve` and `paged_jax/configs`,
so installing paged-jax beside another project never adds a top-level `serve` or `configs` to site-packages.
Code in `serve/` imports itself relatively for that reason.
"""

from setuptools import find_namespace_packages, find_packages, setup

# The kernels' folders include data-only ones (cpu/: the C++ kernel's source, built on first use): found as
# namespace packages, so setuptools installs them instead of warning that they would be ignored.
KERNELS = find_namespace_packages(include=["pallas_kernels", "pallas_kernels.*"], exclude=["*.__pycache__"])
PACKAGES = [*find_packages(include=["paged_jax", "paged_jax.*"]), *KERNELS]
SERVE = ["paged_jax.serve", *(f"paged_jax.serve.{p}" for p in find_packages("serve"))]

setup(
    packages=[*PACKAGES, *SERVE, "paged_jax.configs"],
    package_dir={"paged_jax.serve": "serve", "paged_jax.configs": "configs"},
    package_data={
        "paged_jax.configs": ["*.json"],
        "pallas_kernels": [
            "cpu/*.cc",
            "cpu/*.h",
            "analysis/h200.txtpb",
        ],  # the CPU kernel's source (built on first use); the H200 target
        "paged_jax.serve.proto.paged_jax.v1": ["*.proto", "*.pyi"],
    },
)
