"""No code that can receive network bytes may deserialise them unsafely.

An AST scan of every module under protocol/, node/, coordinator/ and bench/ fails on:
- `import pickle` / `cPickle` / `dill` / `cloudpickle` / `marshal` / `shelve`, or a
  `from` import of them (and `pickle.loads` and friends reached through any alias);
- `torch.load(...)` without `weights_only=True` (through any alias of torch, or a
  `from torch import load`);
- calls to the builtins `eval`, `exec` (and `builtins.eval` / `builtins.exec`).

The checker itself is tested on planted examples, so it cannot silently pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("protocol", "node", "coordinator", "bench")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
BANNED_BUILTINS = {"eval", "exec"}


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def check_source(source: str, filename: str = "<string>") -> list[str]:
    """Every unsafe deserialisation in `source`, as 'file:line: what' strings."""
    tree = ast.parse(source, filename=filename)
    problems: list[str] = []
    torch_names: set[str] = set()  # local names bound to the torch module
    load_names: set[str] = set()  # local names bound to torch.load

    def bad(node: ast.AST, what: str) -> None:
        problems.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in BANNED_MODULES:
                    bad(node, f"import {alias.name}")
                if alias.name == "torch":
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom):
            root = (node.module or "").split(".")[0]
            if root in BANNED_MODULES:
                bad(node, f"from {node.module} import ...")
            if node.module == "torch":
                for alias in node.names:
                    if alias.name == "load":
                        load_names.add(alias.asname or "load")
            if node.module == "builtins":
                for alias in node.names:
                    if alias.name in BANNED_BUILTINS:
                        bad(node, f"from builtins import {alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in BANNED_BUILTINS:
            bad(node, f"{func.id}(...)")
        elif (
            isinstance(func, ast.Attribute)
            and func.attr in BANNED_BUILTINS
            and isinstance(func.value, ast.Name)
            and func.value.id in ("builtins", "__builtins__")
        ):
            bad(node, f"{func.value.id}.{func.attr}(...)")
        is_torch_load = (
            isinstance(func, ast.Attribute)
            and func.attr == "load"
            and isinstance(func.value, ast.Name)
            and func.value.id in (torch_names or {"torch"})
        ) or (isinstance(func, ast.Name) and func.id in load_names)
        if is_torch_load:
            ok = any(kw.arg == "weights_only" and _is_true(kw.value) for kw in node.keywords)
            if not ok:
                bad(node, "torch.load(...) without weights_only=True")
    return problems


def scanned_files() -> list[Path]:
    files = [p for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))]
    return [p for p in files if ".venv" not in p.parts]


def test_no_unsafe_deserialisation_in_network_code() -> None:
    files = scanned_files()
    assert len(files) > 20, f"scanned only {len(files)} files: is the layout what we think?"
    problems = [p for f in files for p in check_source(f.read_text(), str(f.relative_to(REPO)))]
    assert problems == [], "unsafe deserialisation:\n" + "\n".join(problems)


def test_checker_catches_planted_examples() -> None:
    planted = {
        "import pickle\n": "import pickle",
        "import pickle as p\np.loads(b'')\n": "import pickle",
        "from pickle import loads\n": "from pickle import",
        "import _pickle\n": "import _pickle",
        "import dill\n": "import dill",
        "import marshal\n": "import marshal",
        "from cloudpickle import loads\n": "from cloudpickle import",
        "import torch\ntorch.load('f')\n": "weights_only",
        "import torch\ntorch.load('f', weights_only=False)\n": "weights_only",
        "import torch as t\nt.load('f', map_location='cpu')\n": "weights_only",
        "from torch import load\nload('f')\n": "weights_only",
        "from torch import load as L\nL('f')\n": "weights_only",
        "eval('1+1')\n": "eval(",
        "exec('x = 1')\n": "exec(",
        "import builtins\nbuiltins.eval('1')\n": "builtins.eval",
        "from builtins import exec\n": "from builtins import exec",
        "def f(b):\n    return eval(b.decode())\n": "eval(",
    }
    for source, expect in planted.items():
        found = check_source(source, "planted.py")
        assert found and any(expect in p for p in found), (source, found)


def test_checker_accepts_safe_code() -> None:
    safe = [
        "import torch\ntorch.load('f', weights_only=True)\n",
        "import torch as t\nt.load('f', map_location='cpu', weights_only=True)\n",
        "import json\njson.loads('{}')\n",
        "import msgpack\nmsgpack.unpackb(b'', raw=False)\n",
        "model.eval()\n",  # nn.Module.eval is not the builtin
        "x = {'eval': 1}\n",
        "import safetensors.torch\nsafetensors.torch.load_file('f')\n",
    ]
    for source in safe:
        assert check_source(source) == [], source
