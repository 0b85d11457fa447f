"""Bookkeeping is torch-free; the import rules of DESIGN (checked on every import statement, by AST)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TORCH_FREE = ["ember.kv.block_hash", "ember.kv.chunks", "ember.kv.transfer", "ember.kv.bulk",
              "ember.engine.block_manager", "ember.engine.scheduler", "ember.engine.sampling_params",
              "ember.engine.constraints", "ember.parallel.shard", "ember.placement.memory_plan",
              "ember.services.router.tools", "ember.services.router.openai_choices",
              "ember.engine.sequence", "ember.engine.detokenizer", "ember.model.tokenizer", "ember.model.files",
              "ember.config.schema", "ember.config.load", "ember.config.derived", "ember.config.services",
              "ember.config.explain", "ember.model.args", "ember.engine.config", "ember.services.common",
              "ember.cluster.launcher", "ember.services.kvstore.store",
              "ember.services.kvstore.service", "ember.services.router.service",
              "ember.kv.wire", "ember.kv.codec", "ember.kv.shm", "ember.kv.directory", "ember.services.kvstore.pull",
              "ember.services.kvstore.publisher", "ember.placement.policy",
              "ember.placement.simulate", "ember.placement.trace", "ember.placement.cli", "ember.cluster.wan",
              "ember.rpc.site_kv", "ember.rpc.kv_connector", "ember.engine.outputs", "ember.serving.messages",
              # the service process of an engine-backed service: the model lives in its engine core
              "ember.serving.engine_client", "ember.services.prefill.service", "ember.services.decode.service"]
ROOT = Path(__file__).resolve().parents[1]
# folder -> package, as pyproject.toml's [tool.setuptools.package-dir] installs them
PACKAGE_DIRS = {"ember": "ember", "services": "ember.services"}


def module_of(path: Path, root: Path = ROOT) -> tuple[str, bool]:
    """The dotted module name a source file under `root` installs as, and whether it is a package."""
    top, *rest = path.resolve().relative_to(root.resolve()).with_suffix("").parts
    parts = PACKAGE_DIRS[top].split(".") + rest
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def imports_in(source: str, module: str, is_package: bool = False, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, absolute module) for every import anywhere in `source`: at top level, in functions,
    classes, try blocks and `if TYPE_CHECKING:`; relative imports resolved against `module`;
    `from X import a` also yields X.a (a may be a submodule); importlib.import_module / __import__
    with a literal name count too."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    raise ValueError(f"{filename}:{node.lineno}: relative import beyond the top-level package")
                base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")
                   or isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    return imports_in(path.read_text(), *module_of(path, root), filename=str(path))


def is_under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(folder: str, bad, allowed: set[tuple[str, str]] = frozenset(), root: Path = ROOT) -> list[str]:
    """'file:line imports module' for each import in root/folder that bad(module) flags, less the
    (file, module) pairs in `allowed`; `from a.b import c` flagged as a.b is not repeated as a.b.c."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        flagged = [(line, m) for line, m in imports_of(path, root) if bad(m)]
        out += [f"{rel}:{line} imports {m}" for line, m in flagged if (rel, m) not in allowed
                and not any(other == line and m.startswith(o + ".") for other, o in flagged)]
    return out


def test_the_checker_sees_imports_anywhere_and_resolves_relative_ones():
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ember.v1 import kv_pb2\n"
        "def f():\n"
        "    import torch.nn as nn\n"
        "    try:\n"
        "        from grpc import aio\n"
        "    except ImportError:\n"
        "        pass\n"
        "class C:\n"
        "    def m(self):\n"
        "        from ..decode import service\n"
        "        from . import store\n"
        "        from .common import x\n"
        "        return importlib.import_module('ember.services.router.stubs')\n"
    )
    found = imports_in(source, "ember.services.kvstore.pull")
    assert {(4, "ember.v1.kv_pb2"), (6, "torch.nn"), (8, "grpc.aio"), (13, "ember.services.decode"),
            (13, "ember.services.decode.service"), (14, "ember.services.kvstore.store"),
            (15, "ember.services.kvstore.common"), (16, "ember.services.router.stubs")} <= set(found)
    # in a package's __init__, "." is the package itself
    assert imports_in("from .store import S\n", "ember.services.kvstore", is_package=True) == \
        [(1, "ember.services.kvstore.store"), (1, "ember.services.kvstore.store.S")]
    with pytest.raises(ValueError, match="beyond"):
        imports_in("from .... import x\n", "ember.services.kvstore.pull")
    assert module_of(ROOT / "services" / "kvstore" / "store.py") == ("ember.services.kvstore.store", False)
    assert module_of(ROOT / "services" / "__init__.py") == ("ember.services", True)
    # the old column-0 line check saw none of the imports inside blocks
    assert [line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))] == \
        ["__future__", "typing"]


def test_the_rules_flag_nested_imports_in_a_file(tmp_path):
    bad = tmp_path / "services" / "kvstore" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    if True:\n        import torch\n        from ..router import service\n")
    assert violations("services/kvstore", _torch, root=tmp_path) == ["services/kvstore/bad.py:3 imports torch"]
    assert violations("services/kvstore", _other_service("kvstore"), root=tmp_path) == [
        "services/kvstore/bad.py:4 imports ember.services.router"]
    assert violations("services/kvstore", _torch, {("services/kvstore/bad.py", "torch")}, root=tmp_path) == []


def test_bookkeeping_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) + \
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_router_starts_without_numpy_or_redis():
    """Start-up CPU (issue 32): the router's process imports redis (~0.3 s) only for a configured Redis
    and numpy only where a link is priced; a module-level import of either is back on every start."""
    code = "import sys\nimport ember.services.router.__main__\n" \
        "assert not {'numpy', 'redis'} & set(sys.modules), sorted({'numpy', 'redis'} & set(sys.modules))\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ember_never_imports_services():
    # `services` too: the folder's old top-level package name
    assert violations("ember", lambda m: is_under(m, "ember.services", "services")) == []


def _other_service(service: str):
    def bad(m: str) -> bool:
        parts = m.split(".")
        parts = parts[1:] if parts[0] == "ember" else parts
        return parts[0] == "services" and len(parts) > 1 and parts[1] not in (service, "common")
    return bad


def _torch(m: str) -> bool:
    return is_under(m, "torch")


@pytest.mark.parametrize("service", ["router", "prefill", "decode", "kvstore"])
def test_services_never_import_each_other(service):
    assert violations(f"services/{service}", _other_service(service)) == []


@pytest.mark.parametrize("package", ["engine", "model", "kernels"])
def test_core_never_touches_generated_stubs_or_grpc(package):
    assert violations(f"ember/{package}", lambda m: is_under(m, "ember.v1") or m.split(".")[0].startswith("grpc")) == []


def test_the_product_never_imports_the_benchmarks():
    """Benchmarks measure the product; the product's own measuring (the parallel planners' costs) lives in
    ember.util.timing. Only `ember bench` (ember/cli.py) reaches the benchmarks."""
    def bench(m: str) -> bool:
        return is_under(m, "ember.bench")
    found = violations("ember", bench) + violations("services", bench)
    assert [v for v in found if not v.startswith(("ember/bench/", "ember/cli.py:"))] == []


def test_the_kvstore_never_imports_torch():
    """It stores bytes (the runtime check is TORCH_FREE above)."""
    assert violations("services/kvstore", _torch) == []


# Known exceptions to "kernels never import the model" (DESIGN: "today the arrow runs both ways").
# Neither goes away inside one file: apply_rope lives in ember/model/llama.py (the model's own layer
# uses it, and the int4 decode_layer must compute the same rope); drop_resident_pages belongs to the
# mapped-tensor registry of ember/model/safetensors_io.py. Remove an entry when its import goes.
KERNELS_IMPORT_MODEL = {("ember/kernels/cpu_int4.py", "ember.model.llama"),
                        ("ember/kernels/cpu_linear.py", "ember.model.safetensors_io")}


def test_kernels_never_import_the_model():
    def model(m: str) -> bool:
        return is_under(m, "ember.model")
    assert violations("ember/kernels", model, KERNELS_IMPORT_MODEL) == []
    still = {(v.split(":")[0], v.split(" imports ")[1]) for v in violations("ember/kernels", model)}
    assert still == KERNELS_IMPORT_MODEL, "an exception is gone: remove it from KERNELS_IMPORT_MODEL"


def test_omp_wait_policy_passive_unless_opted_out():
    """Ember processes wait passively (co-located processes would collapse each other); a process
    alone on its cores can keep libgomp's spin with EMBER_OMP_PASSIVE=0."""
    import os
    code = "import os, ember; print(os.environ.get('OMP_WAIT_POLICY'))"
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "EMBER_OMP_PASSIVE")}
    def policy(**extra) -> str:
        return subprocess.run([sys.executable, "-c", code], env=base | extra, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
    assert policy() == "PASSIVE"
    assert policy(EMBER_OMP_PASSIVE="0") == "None"
    assert policy(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
