"""The package boundaries, checked by reading the source.

The repository's packages are `protocol`, `ingest`, `node`, `coordinator`, `bench` and
`swarmlab` (the local-swarm tools; the checks hold whether or not it exists yet). Their
rules:

- `protocol` is sans-I/O: it imports no torch, sockets, event loop (asyncio, trio),
  networking stack (libp2p, hivemind), file-system or OS module (os, pathlib, sysconfig,
  glob, shutil, tempfile, subprocess), and neither `node` nor `coordinator`.
- `ingest` (reading datasets and tokenizers from disk, for both sides) imports only
  `protocol`: no torch, sockets, event loop or networking stack, no other package.
- `node` and `coordinator` never import each other; they meet only in `protocol` and
  `ingest`.
- `coordinator` loads without torch, libp2p, hivemind or trio.
- hivemind and libp2p cannot share a process: only `node.outer` (the outer-loop process)
  imports hivemind, and it never imports libp2p.
- `bench` and `swarmlab` never import hivemind or libp2p directly; they reach the outer
  loop through a public function or by running processes.
- `protocol`, `node` and `coordinator` never import `bench`, `swarmlab` or `tests`.
- No import cycles among the repository's modules.

"Imports" means every import statement, also those inside functions and under
`if TYPE_CHECKING:` (two modules that name each other's types depend on each other), with
relative imports resolved and `from pkg import name` counted as importing `pkg.name` when
that is a module. Modules named in strings count as well: `importlib.import_module("...")`
targets, "module:function" entry points (e.g. a subcommand table) and `-m MODULE` in a
command-line list (`[sys.executable, "-m", "node.main"]`) must name modules that exist
and obey the same rules, with one deliberate exception (`ALLOWED_CROSSINGS`): the
coordinator runs the stand-alone relay, a node module, as a child process. A
`python -m MODULE` mentioned in text (docstrings, help) must name an existing module.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "ingest", "node", "coordinator", "bench", "swarmlab")

# (referring module, referenced module): the only crossings of the rules below, by name.
ALLOWED_CROSSINGS = {
    # `agora-coordinator --relay` runs `python -m node.p2p.relay_main` as a child process
    # and reads its stdout; it never imports it (coordinator/relay_child.py says why).
    ("coordinator.relay_child", "node.p2p.relay_main"),
}

FILE_SYSTEM_AND_OS = {"os", "pathlib", "sysconfig", "glob", "shutil", "tempfile", "subprocess"}
BANNED: dict[str, set[str]] = {
    "protocol": {"torch", "socket", "asyncio", "trio", "libp2p", "hivemind"}
    | FILE_SYSTEM_AND_OS
    | {"ingest", "node", "coordinator", "bench", "swarmlab", "tests"},
    "ingest": {"torch", "socket", "asyncio", "trio", "libp2p", "hivemind"}
    | {"node", "coordinator", "bench", "swarmlab", "tests"},
    "coordinator": {"node", "torch", "libp2p", "hivemind", "trio", "bench", "swarmlab", "tests"},
    "node": {"coordinator", "bench", "swarmlab", "tests"},
    "bench": {"hivemind", "libp2p"},
    "swarmlab": {"hivemind", "libp2p"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(f): f for pkg in PACKAGES for f in sorted((REPO / pkg).rglob("*.py"))}


MODULES = _all_modules()


@dataclass(frozen=True)
class Use:
    """One module naming another: `how` is import, import_module, entry, -m or text."""

    source: str
    target: str
    how: str
    line: int
    attr: str = ""  # the function of a "module:function" entry


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


ENTRY = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)")
PYTHON_M = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*[A-Za-z_0-9])")


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _uses(module: str, source: str, *, is_package: bool) -> Iterator[Use]:
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Use(module, alias.name, "import", line)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            yield Use(module, base, "import", line)
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    yield Use(module, f"{base}.{alias.name}", "import", line)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target = _text(node.args[0]) if node.args else None
            if name == "import_module" and target is not None:
                yield Use(module, target, "import_module", line)
        elif isinstance(node, ast.List | ast.Tuple):
            for flag, arg in zip(node.elts, node.elts[1:], strict=False):
                target = _text(arg)
                if _text(flag) == "-m" and target is not None:
                    yield Use(module, target, "-m", line)
        elif (text := _text(node)) is not None:
            entry = ENTRY.fullmatch(text)
            if entry and entry.group(1).split(".")[0] in PACKAGES:
                yield Use(module, entry.group(1), "entry", line, attr=entry.group(2))
            for mentioned in PYTHON_M.findall(text):
                yield Use(module, mentioned, "text", line)


USES = [
    use
    for module, path in MODULES.items()
    for use in _uses(module, path.read_text(), is_package=path.name == "__init__.py")
]


def _where(use: Use) -> str:
    return f"{MODULES[use.source].relative_to(REPO)}:{use.line}: {use.how} {use.target}"


def _breaks_rules(use: Use) -> bool:
    """Whether `use` breaks a package rule (ALLOWED_CROSSINGS are not consulted here)."""
    pkg, top = use.source.split(".")[0], use.target.split(".")[0]
    if use.source == "node.outer" or use.source.startswith("node.outer."):
        return top in BANNED["node"] | {"libp2p"}
    if pkg == "node" and top == "hivemind":
        return True
    return top in BANNED.get(pkg, set())


def _import_breaks(*packages: str) -> list[str]:
    return [
        _where(u)
        for u in USES
        if u.how == "import" and u.source.split(".")[0] in packages and _breaks_rules(u)
    ]


# --- imports ---------------------------------------------------------------------------------


def test_the_reader_sees_nested_relative_from_and_string_uses() -> None:
    source = '''
def f():
    import os
    from .. import p2p
    from node.p2p import host, Libp2pTransport
    importlib.import_module("coordinator.audit")
    run([sys.executable, "-m", "node.main", "--x"])
TABLE = {"a": ("node.export:main", "help: not an entry"), "b": "localhost:7700"}
"""Run `python -m node.p2p.relay_main`."""
'''
    got = {(u.how, u.target, u.attr) for u in _uses("node.p2p.fake", source, is_package=False)}
    assert got == {
        ("import", "os", ""),
        ("import", "node", ""),
        ("import", "node.p2p", ""),
        ("import", "node.p2p.host", ""),
        ("import_module", "coordinator.audit", ""),
        ("-m", "node.main", ""),
        ("entry", "node.export", "main"),
        ("text", "node.p2p.relay_main", ""),
    }


def test_protocol_is_sans_io_and_imports_no_other_package() -> None:
    assert not _import_breaks("protocol")


def test_ingest_imports_only_protocol_and_no_torch_or_network() -> None:
    assert not _import_breaks("ingest")


def test_coordinator_imports_no_node_tools_torch_libp2p_hivemind_or_trio() -> None:
    assert not _import_breaks("coordinator")


def test_node_imports_no_coordinator_or_tools_and_only_node_outer_imports_hivemind() -> None:
    assert not _import_breaks("node")


def test_bench_and_swarmlab_never_import_hivemind_or_libp2p() -> None:
    assert not _import_breaks("bench", "swarmlab")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_the_repositorys_modules() -> None:
    """An import of `a.b.c` is an edge to that module only, not to its parent packages."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for use in USES:
        if use.how == "import" and use.target in MODULES and use.target != use.source:
            graph[use.source].add(use.target)
    assert not _cycles(graph)


# --- modules named in strings ----------------------------------------------------------------
def _defines(module: str, name: str) -> bool:
    """Whether `module` binds `name` at its top level (def, class, assignment or import)."""
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound = [node.name]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound = [a.asname or a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.Assign):
            bound = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound = [node.target.id]
        else:
            bound = []
        if name in bound:
            return True
    return False


def test_modules_named_in_strings_exist() -> None:
    missing = [
        _where(u)
        for u in USES
        if u.how != "import" and u.target.split(".")[0] in PACKAGES and u.target not in MODULES
    ]
    assert not missing
    no_function = [
        f"{_where(u)}:{u.attr}"
        for u in USES
        if u.how == "entry" and u.target in MODULES and not _defines(u.target, u.attr)
    ]
    assert not no_function


def test_modules_named_in_strings_obey_the_package_rules() -> None:
    bad = [
        _where(u)
        for u in USES
        if u.how in ("import_module", "entry", "-m")
        and _breaks_rules(u)
        and (u.source, u.target) not in ALLOWED_CROSSINGS
    ]
    assert not bad


def test_the_allowed_crossings_are_still_there() -> None:
    """Each exception names a use that exists, so a stale one cannot hide a new crossing."""
    used = {(u.source, u.target) for u in USES if u.how in ("import_module", "entry", "-m")}
    assert used >= ALLOWED_CROSSINGS
    assert all(_breaks_rules(Use(s, t, "-m", 0)) for s, t in ALLOWED_CROSSINGS)


# --- what actually loads ---------------------------------------------------------------------


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


MAX_LINES = 550  # about 500: past this, a module is split along a real seam


def test_modules_stay_small() -> None:
    """A module does one job and reads top to bottom; none passes about 500 lines."""
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
