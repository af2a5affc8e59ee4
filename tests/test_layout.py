"""Import direction of the product, read from the source (no module is imported).

The rules: nothing under services/ imports the top-level `tools` package; the DiT's `model/` never imports its
`stream/` or `group/`, and `stream/` never imports `group/`; the gateway never imports torch or `services.tensors`,
directly or through a project module it imports; `services/common/` imports torch only inside functions; and no
module under services/ is a benchmark, profiler or probe (those live in tools/). tests/gateway/test_no_torch.py
checks the gateway's torch-freedom at run time as well.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
# top-level packages that load torch when imported
TORCH_PACKAGES = frozenset({"torch", "diffusers", "peft", "triton"})
TOOL_PREFIXES = ("bench_", "profile_", "probe")


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's target, as an absolute dotted name."""

    target: str
    """the imported module, or `package.name` for `from package import name`"""
    top_level: bool
    """True when the statement runs at import time (not inside a function)"""
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _function_scoped(tree: ast.Module) -> set[int]:
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner.update(id(child) for child in ast.walk(node) if child is not node)
    return inner


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every import in one file, relative imports made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module, is_package = module_name(root, path), path.name == "__init__.py"
    inner, found = _function_scoped(tree), []
    for node in ast.walk(tree):
        top = id(node) not in inner
        if isinstance(node, ast.Import):
            found += [Import(alias.name, top, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            found.append(Import(base, top, node.lineno))
            found += [Import(f"{base}.{alias.name}", top, node.lineno) for alias in node.names if alias.name != "*"]
    return found


def scan(root: Path) -> dict[str, tuple[Path, list[Import]]]:
    """Module name -> (file, imports) for every .py file under root/services and root/vitascope."""
    modules = {}
    for package in ("services", "vitascope"):
        for path in sorted((root / package).rglob("*.py")):
            modules[module_name(root, path)] = (path, imports_of(root, path))
    return modules


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _packages_of(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _loads_torch(modules, start: str) -> list[str] | None:
    """The chain of module-level imports from `start` to a torch package or services.tensors, if any."""
    seen, stack = {start}, [[start]]
    while stack:
        chain = stack.pop()
        for imp in modules[chain[-1]][1]:
            if not imp.top_level and len(chain) > 1:
                continue  # a dependency's lazy import does not run when the gateway imports it
            if imp.target.split(".")[0] in TORCH_PACKAGES or _within(imp.target, "services.tensors"):
                return chain + [imp.target]
            for name in _packages_of(imp.target):  # importing a.b.c runs a, a.b and a.b.c
                if name in modules and name not in seen:
                    seen.add(name)
                    stack.append(chain + [name])
    return None


def violations(root: Path) -> list[str]:
    """Every broken layout rule under root, one readable line per statement and rule."""
    modules, found = scan(root), {}

    def report(where: Path, imp: Import, rule: str) -> None:
        found.setdefault((str(where), imp.line, rule), f"{where}:{imp.line} imports {imp.target}: {rule}")

    for module, (path, imports) in modules.items():
        where = path.relative_to(root)
        if not _within(module, "services"):
            continue
        if path.stem.startswith(TOOL_PREFIXES):
            found[(str(where), 0, "tool")] = (f"{where}: a benchmark/profiler/probe module inside services/ "
                                              "(move it to tools/)")
        for imp in imports:
            if _within(imp.target, "tools"):
                report(where, imp, "the product never imports tools/")
            if _within(module, "services.dit.model") and (
                    _within(imp.target, "services.dit.stream") or _within(imp.target, "services.dit.group")):
                report(where, imp, "model/ never imports stream/ or group/")
            if _within(module, "services.dit.stream") and _within(imp.target, "services.dit.group"):
                report(where, imp, "stream/ never imports group/")
            if _within(module, "services.common") and imp.top_level and imp.target.split(".")[0] in TORCH_PACKAGES:
                report(where, imp, "services/common imports torch only inside functions")
        if _within(module, "services.gateway"):
            chain = _loads_torch(modules, module)
            if chain is not None:
                found[(str(where), 0, "torch")] = (f"{where}: the gateway loads torch or services.tensors: "
                                                   f"{' -> '.join(chain)}")
    return sorted(found.values())


def test_the_product_keeps_its_import_directions():
    assert scan(ROOT), "no modules found"
    assert violations(ROOT) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_every_rule_reports_a_tree_that_breaks_it(tmp_path):
    inits = {f"{p}/__init__.py": "" for p in ("services", "services/dit", "services/dit/model", "services/dit/stream",
                                               "services/dit/group", "services/common", "services/gateway",
                                               "services/tensors", "vitascope")}
    _write(tmp_path, inits | {
        "services/dit/model/network.py": "from services.dit.stream import runtime\n",
        "services/dit/model/shard.py": "def f():\n    from ..group import ulysses\n",
        "services/dit/stream/runtime.py": "import services.dit.group.launch\n",
        "services/dit/group/ulysses.py": "from services.dit.model import network\n",  # allowed direction
        "services/common/media.py": "import torch\n",
        "services/common/metrics.py": "def f():\n    import torch\n",  # allowed: lazy
        "services/common/config.py": "from services.common import media\n",
        "services/gateway/ws.py": "from services.common.config import X\n",  # torch two hops away
        "services/gateway/pipeline.py": "def f():\n    from services.tensors.transport import t\n",
        "services/gateway/metrics.py": "from services.common.metrics import f\n",  # allowed: lazy torch
        "services/up.py": "import tools.bench\n",
        "services/dit/bench_attention.py": "",
        "services/vae/__init__.py": "",
        "services/vae/probe_mux.py": "",
        "services/encoder/__init__.py": "",
        "services/encoder/profile_text.py": "",
    })
    found = "\n".join(violations(tmp_path))
    expected = [
        "services/dit/model/network.py:1 imports services.dit.stream: model/ never imports stream/ or group/",
        "services/dit/model/shard.py:2 imports services.dit.group: model/ never imports",
        "services/dit/stream/runtime.py:1 imports services.dit.group.launch: stream/ never imports group/",
        "services/common/media.py:1 imports torch: services/common imports torch only inside functions",
        "services/gateway/ws.py: the gateway loads torch or services.tensors: services.gateway.ws -> "
        "services.common.config -> services.common.media -> torch",
        "services/gateway/pipeline.py: the gateway loads torch or services.tensors: services.gateway.pipeline -> "
        "services.tensors.transport",
        "services/up.py:1 imports tools.bench: the product never imports tools/",
        "services/dit/bench_attention.py: a benchmark/profiler/probe module",
        "services/vae/probe_mux.py: a benchmark/profiler/probe module",
        "services/encoder/profile_text.py: a benchmark/profiler/probe module",
    ]
    for line in expected:
        assert line in found, f"not reported: {line}\n{found}"
    assert "group/ulysses.py" not in found and "common/metrics.py" not in found and "gateway/metrics.py" not in found
    assert len(found.splitlines()) == len(expected), found
