"""Regenerate the Python code for `serve/proto/**/*.proto`: `python -m serve.codegen [--out DIR]`.

protoc runs with the repository root as its include path (so the generated modules never shadow the
`paged_jax` package); the gRPC module's import of its messages is then made relative, since `serve/` installs
as `paged_jax.serve`. The generated `*_pb2.py`,
`*_pb2_grpc.py` and `*_pb2.pyi` files are committed; `tests/serve/test_serve_proto.py` regenerates them into
a temporary directory and fails when the committed ones drift from the `.proto`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "serve" / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generated_files(out: Path = ROOT) -> list[Path]:
    """Where the generated modules of every `.proto` land under `out`."""
    paths = []
    for proto in proto_files():
        stem = proto.relative_to(ROOT).with_suffix("")
        paths += [out / f"{stem}{suffix}" for suffix in GENERATED_SUFFIXES]
    return paths


def generate(out: Path = ROOT) -> list[Path]:
    """Run protoc (grpcio-tools) over every `.proto`; return the files written."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for path in generated_files(out):
        if path.name.endswith("_pb2_grpc.py"):  # its own proto's module, relatively: serve installs as paged_jax.serve
            path.write_text(_relative(path.read_text()))
    return generated_files(out)


def _relative(code: str) -> str:
    """`from serve.proto.<pkg> import x_pb2 as ...` (protoc's absolute import) as `from . import x_pb2 as ...`."""
    lines = []
    for line in code.splitlines(keepends=True):
        head, sep, rest = line.partition(" import ")
        if sep and head.startswith("from serve.proto.") and rest.split(" ")[0].endswith("_pb2"):
            line = f"from . import {rest}"
        lines.append(line)
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
