"""The package arrows point one way: http -> engine -> model -> parallel.

Every ``import`` in every module of ``tpserve`` (function-level imports included) is read
from the source and checked against the layer rules below; an arrow that runs back up
fails with the module and the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tpserve

ROOT = Path(tpserve.__file__).parent

# layer -> the tpserve layers its modules may import (a layer may always import itself and
# the root package, which holds only the version)
ALLOWED = {
    "tpserve.parallel": set(),
    "tpserve.model": {"tpserve.parallel"},
    "tpserve.server.engine": {"tpserve.model", "tpserve.parallel"},
    "tpserve.server.http": {"tpserve.server.engine", "tpserve.model"},
    # the process layout (config tree, serve, startup, engine process and its proxy)
    "tpserve.server": {"tpserve.server.http", "tpserve.server.engine", "tpserve.model",
                       "tpserve.parallel"},
    "tpserve.loadtest": set(),  # talks to servers over HTTP only
    "tpserve.cli": {"tpserve.server", "tpserve.loadtest"},
    "tpserve": set(),
}
# the most specific layer wins
LAYERS = sorted(ALLOWED, key=len, reverse=True)


def layer_of(module: str) -> str:
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} is in no layer")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from tpserve.server import http`` imports the module ``tpserve.server.http``
            base = root.parent / node.module.replace(".", "/")
            for a in node.names:
                sub = base / a.name
                is_module = sub.is_dir() or sub.with_suffix(".py").is_file()
                found.append((node.lineno, f"{node.module}.{a.name}" if is_module
                              else node.module))
    return [(line, m) for line, m in found if m == "tpserve" or m.startswith("tpserve.")]


def violations(root: Path = ROOT) -> list[str]:
    """Every import in the package at ``root`` that breaks ``ALLOWED``."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        src = layer_of(module_name(path, root))
        for line, target in imported_modules(path, root):
            dst = layer_of(target)
            if dst not in (src, "tpserve") and dst not in ALLOWED[src]:
                bad.append(f"{path.relative_to(root.parent)}:{line}: {src} -> {dst} ({target})")
    return bad


def test_no_arrow_runs_back_up():
    assert violations() == []


def test_the_check_sees_back_arrows(tmp_path):
    """The walker itself, on a small package: a function-level import of the engine from
    the model and a ``from ... import subpackage`` of HTTP from the engine are reported."""
    pkg = tmp_path / "tpserve"
    for d in ("model", "server/engine", "server/http"):
        (pkg / d).mkdir(parents=True)
    (pkg / "model" / "probe.py").write_text(
        "import torch\n\ndef f():\n    from tpserve.server.engine.scheduler import S\n")
    (pkg / "server" / "engine" / "probe.py").write_text(
        "from tpserve.model import probe\nfrom tpserve.server import http\n")
    assert violations(pkg) == [
        "tpserve/model/probe.py:4: tpserve.model -> tpserve.server.engine "
        "(tpserve.server.engine.scheduler)",
        "tpserve/server/engine/probe.py:2: tpserve.server.engine -> tpserve.server.http "
        "(tpserve.server.http)"]


@pytest.mark.parametrize("module, layer", [
    ("tpserve.server.http.app", "tpserve.server.http"),
    ("tpserve.server.engine.scheduler", "tpserve.server.engine"),
    ("tpserve.server.serve", "tpserve.server"),
    ("tpserve.model.kernels.torch_ops", "tpserve.model"),
    ("tpserve.cli", "tpserve.cli"),
])
def test_layers_are_assigned_by_the_most_specific_prefix(module, layer):
    assert layer_of(module) == layer
