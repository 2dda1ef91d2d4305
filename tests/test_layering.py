"""Guards the package boundaries of DESIGN.md sections 2 and 3 by reading imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def _files(pkg: str) -> list[Path]:
    return sorted((REPO / pkg).rglob("*.py"))


def test_protocol_imports_no_torch_sockets_or_event_loop() -> None:
    banned = {"torch", "socket", "asyncio", "trio", "node", "coordinator", "libp2p", "hivemind"}
    for f in _files("protocol"):
        assert not _top(_imports(f)) & banned, f


def test_node_and_coordinator_never_import_each_other() -> None:
    for f in _files("node"):
        assert "coordinator" not in _top(_imports(f)), f
    for f in _files("coordinator"):
        assert not _top(_imports(f)) & {"node", "torch", "libp2p", "hivemind", "trio"}, f


def test_only_node_outer_imports_hivemind_and_it_never_imports_libp2p() -> None:
    outer = REPO / "node" / "outer"
    for f in _files("node"):
        tops = _top(_imports(f))
        if outer in f.parents:
            assert "libp2p" not in tops, f
        else:
            assert "hivemind" not in tops, f


def test_importing_protocol_does_not_load_torch() -> None:
    code = "import protocol, sys; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_coordinator_package_loads_without_torch() -> None:
    code = (
        "import pkgutil, importlib, sys, coordinator\n"
        "for m in pkgutil.walk_packages(coordinator.__path__, 'coordinator.'):\n"
        "    importlib.import_module(m.name)\n"
        "assert 'torch' not in sys.modules and 'libp2p' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
