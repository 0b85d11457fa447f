"""Generates the gRPC stubs (ember/v1, never committed) from proto/ before the package is built,
so `pip install .` from a clean clone gives a complete package. Everything else is in pyproject.toml."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self):
        from grpc_tools import protoc
        protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto" / "ember" / "v1").glob("*.proto"))
        args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={ROOT}", f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}"]
        if protoc.main(args + [str(ROOT / p) for p in protos]) != 0:
            raise RuntimeError("protoc failed on " + " ".join(protos))
        (ROOT / "ember" / "v1" / "__init__.py").touch()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
