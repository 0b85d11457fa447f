"""Generates the gRPC stubs (ember/v1, never committed) from proto/ before setuptools looks at the
packages, so `pip install .` from a clean clone gives a complete package. Everything else is in
pyproject.toml."""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def generate_stubs() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    protos = sorted(str(p) for p in (ROOT / "proto" / "ember" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={ROOT}", f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}"]
    if protoc.main(args + protos) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))
    (ROOT / "ember" / "v1" / "__init__.py").touch()


generate_stubs()
setup()
