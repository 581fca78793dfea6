"""The layers of the house, checked from the source: no import circle anywhere (library, oracle, tests,
benchmarks), kvcache never imports decode, the library (kvcache, decode outside decode.app) never imports
`reference` or the programs, and reference imports nothing of ours; every module imports; no module (tests and
benchmarks included) uses another module's ``_private`` names; module names are unique. The graph is read from
the AST of every file (imports inside functions included), so a lazy import counts like any other."""
import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kvcache", "decode", "reference")
USERS = PACKAGES + ("tests", "benchmarks")       # everything whose use of private names is checked


def module_files(packages=PACKAGES) -> dict[str, pathlib.Path]:
    """{dotted module name: file} of every module of ``packages`` (by default the library and the oracle)."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: pathlib.Path, modules) -> set[str]:
    """Our modules that ``name`` (the module in ``path``) imports: ``from x import y`` names module ``x.y`` when
    that is a module, else ``x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:      # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
    modules = module_files(packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def is_library(module: str) -> bool:
    return module.split(".")[0] in ("kvcache", "decode") and not (module == "decode.app" or
                                                                    module.startswith("decode.app."))


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes the wrong way between the layers."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            top = target.split(".")[0]
            if module.startswith("kvcache") and top == "decode":
                bad.append(f"{module} -> {target}: kvcache never imports decode")
            if is_library(module) and (top == "reference" or target == "decode.app" or target.startswith("decode.app.")):
                bad.append(f"{module} -> {target}: the library never imports reference or the programs")
            if module.startswith("reference") and top != "reference":
                bad.append(f"{module} -> {target}: reference imports nothing of ours")
    return bad


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def owned_privates(tree: ast.AST) -> set[str]:
    """The private names a module owns: its functions, classes, assigned names, arguments and import aliases,
    and the attributes its own classes store or list in ``__slots__``."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.alias):
            own.add(node.asname or node.name)
        if isinstance(node, ast.ClassDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    own.add(sub.attr)
                elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    own.add(sub.value)
    return {name for name in own if is_private(name)}


def self_attributes(tree: ast.AST) -> set[int]:
    """ids of the ``self.<name>`` nodes inside functions whose first argument is ``self``: a method's own state,
    also where the function is a replacement method planted on another module's class (`monkeypatch`)."""
    found = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args and fn.args.args[0].arg == "self":
            found.update(id(n) for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                         and isinstance(n.value, ast.Name) and n.value.id == "self")
    return found


def private_uses(sources: dict[str, str]) -> list[str]:
    """Every use of another module's private name in ``sources`` ({label: source}): ``from m import _x`` from a
    module of ours (relative imports included), and ``obj._x`` where ``_x`` is not this module's own but another
    module's (a function, global or class attribute of it), other than ``self._x`` in a method."""
    trees = {label: ast.parse(text, label) for label, text in sources.items()}
    owned = {label: owned_privates(tree) for label, tree in trees.items()}
    everyone = set().union(*owned.values())
    bad = []
    for label, tree in trees.items():
        mine = self_attributes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in USERS):
                bad += [f"{label}:{node.lineno}: from {node.module or '.'} import {a.name}" for a in node.names
                        if is_private(a.name)]
            elif (isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr in everyone
                  and node.attr not in owned[label] and id(node) not in mine):
                bad.append(f"{label}:{node.lineno}: .{node.attr}")
    return bad


def test_the_checks_can_fail():
    """The checks themselves, on graphs made to be wrong."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    wrong = {"kvcache.cache": {"decode.attention"}, "decode.decoder": {"reference.dense"},
             "decode.hf.paged_cache": {"decode.app.cli"}, "reference.oracle": {"kvcache"},
             "decode.app.demo": {"reference.dense", "decode"}}
    assert len(layer_violations(wrong)) == 4
    sources = {"a.py": "_cache = {}\nclass A:\n    def __init__(self):\n        self._n = 0\n",
               "b.py": "from kvcache.a import _cache\nfrom .a import _cache as c\n",
               "c.py": "import kvcache.a as a\na._cache.clear()\ndef f(obj):\n    return obj._n\n",
               "d.py": "import numpy as _np\ndef patched(self):\n    return self._n, _np\n_own = 1\nx = _own\n"}
    assert [u.split(":")[0] for u in private_uses(sources)] == ["b.py", "b.py", "c.py", "c.py"]


def test_resolves_relative_and_submodule_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from . import c\nfrom .. import b\nfrom ..a import thing\nimport numpy\n"
                    "def f():\n    import pkg.d.Thing\n")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.d", "pkg.sub", "pkg.sub.c"}
    assert imports_of("pkg.sub.m", path, modules) == {"pkg.a", "pkg.b", "pkg.d", "pkg.sub.c"}


def test_no_import_circle():
    graph = import_graph()
    assert "kvcache.transaction" in graph["kvcache.cache"] and "kvcache.appender" in graph["kvcache.transaction"]
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"
    everything = import_graph(USERS)                      # the tests and benchmarks too
    assert find_cycle(everything) is None, f"import circle: {' -> '.join(find_cycle(everything))}"


def test_no_module_uses_another_modules_private_names():
    """Tests and benchmarks included: what they need of a module is its public (or `kvcache.testing`) interface."""
    files = [path for top in USERS for path in sorted((ROOT / top).rglob("*.py"))]
    uses = private_uses({str(path.relative_to(ROOT)): path.read_text() for path in files})
    assert uses == [], "private names used across modules:\n" + "\n".join(uses)


def test_module_names_are_unique():
    """Every module of the library and the oracle has a name of its own (``__init__`` aside)."""
    names = {}
    for name in module_files():
        names.setdefault(name.rpartition(".")[2], []).append(name)
    assert {short: full for short, full in names.items() if len(full) > 1 and short not in PACKAGES} == {}


def test_imports_go_down_the_layers():
    assert layer_violations(import_graph()) == []


@pytest.mark.parametrize("module", sorted(module_files()))
def test_every_module_imports(module):
    if module.startswith(("decode.hf", "decode.app.hf_compare")):
        pytest.importorskip("transformers")
    if module.startswith("decode.distributed"):
        pytest.importorskip("ray")
    if module.startswith(("decode.serve", "decode.app.serve")):
        pytest.importorskip("fastapi")
    if module == "reference.plot":
        pytest.importorskip("matplotlib")
    importlib.import_module(module)
