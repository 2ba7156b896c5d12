#!/usr/bin/env python3
"""Check the package's layers, import cycles and sizes, from the source alone (AST; nothing is imported).

    python scripts/check_layers.py [--root DIR]      (run by ``make lint``; exit status 1 on a failure)

Three rules, each failure printed as ``file:line: what is wrong; what to do``:

(a) Layers. Every module of the installed package (``omnireduce``, its folders mapped by
    pyproject's ``[tool.setuptools.package-dir]``) belongs to a layer by :data:`LAYER_OF` below, and
    may import only from its own layer and from those :data:`MAY_IMPORT` lists: no import to a
    higher layer, nor sideways where the table does not allow it (the aggregator imports the ground
    floor only). Every import counts: at module level, inside functions and under ``TYPE_CHECKING``.
    :data:`NO_TORCH` names the layers that must not import torch (at module level, or anywhere).
(b) Cycles. No import cycle between modules, counting the same imports (a cycle through a
    function-level or ``TYPE_CHECKING`` import is still a cycle of the design).
(c) Sizes. No module over :data:`MAX_MODULE_LINES` lines, no function over
    :data:`MAX_FUNCTION_LINES` lines (from its ``def`` to its last line, docstring included).
(d) The scripts. ``scripts/`` (each script a module of its file's name, as the scripts import each
    other, and the package ``ombench`` beside them) has no import cycle either, and the scripts import
    the package, never the other way: no module of the package imports a script or ``ombench``.

An import of a module that does not exist (yet) is not judged here: running the code finds it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "omnireduce"

# --- the table ---------------------------------------------------------------------------------------
# Layers bottom-up. A module's layer is that of the longest prefix of its name in LAYER_OF; any other
# top-level module of the package is "ground" (numpy and zmq only).

LAYERS = ("ground", "cuda", "sources", "worker", "engines", "launch", "aggregator", "distributed",
          "ddp.values", "ddp.record", "ddp.paths", "ddp.routing", "ddp.runtime", "ddp.state", "ddp",
          "integrations", "bench", "top")
DDP = ("ddp.values", "ddp.record", "ddp.paths", "ddp.routing", "ddp.runtime", "ddp.state", "ddp")
"""The DDP side's own floors, bottom up: its values (the options, a bucket, the densities, the residuals,
compression's options), the recorder, the paths around a reducer, the routing, the runtime and its
binding, the state, and the hook with what sits beside it."""

LAYER_OF = {
    "omnireduce": "top",  # the package's __init__ (lazy public names)
    "omnireduce.__main__": "top",  # python -m omnireduce
    "omnireduce._csrc": "cuda",  # the kernels' sources (package data)
    "omnireduce.cuda": "cuda",
    "omnireduce.sources": "sources",
    "omnireduce.worker": "worker",
    "omnireduce.engines": "engines",
    "omnireduce.launch": "launch",
    "omnireduce.colocate": "launch",  # the kept name of omnireduce.launch.colocate (re-exports only)
    "omnireduce.aggregator": "aggregator",
    "omnireduce.ddp": "ddp",  # the package's face, the hook, optimizer fusion, the older compression names
    "omnireduce.ddp.state": "ddp.state",
    "omnireduce.ddp.runtime": "ddp.runtime",
    "omnireduce.ddp.binding": "ddp.runtime",
    "omnireduce.ddp.routing": "ddp.routing",
    "omnireduce.ddp.paths": "ddp.paths",
    "omnireduce.ddp.recorder": "ddp.record",
    "omnireduce.ddp.options": "ddp.values",
    "omnireduce.ddp.bucket": "ddp.values",
    "omnireduce.ddp.backend": "ddp.values",
    "omnireduce.ddp.densities": "ddp.values",
    "omnireduce.ddp.residuals": "ddp.values",
    "omnireduce.compression": "ddp.values",  # (public name; block top-k with error feedback, for the hook only)
    "omnireduce.integrations": "integrations",
    "omnireduce.distributed": "distributed",  # torch.distributed's all_reduce through the engines
    "omnireduce.bench": "bench",  # omnireduce-bench: measures the layers under it
}

# What each layer may import besides itself.
MAY_IMPORT = {
    "ground": set(),
    "cuda": {"ground"},
    "sources": {"ground", "cuda"},
    "worker": {"ground", "cuda", "sources"},
    "engines": {"ground", "cuda", "sources"},
    "launch": {"ground"},
    "aggregator": {"ground"},
    "distributed": {"ground", "cuda", "sources", "worker", "engines"},
    **{floor: {"ground", "cuda", "sources", "worker", "engines", "launch", *DDP[:i]} for i, floor in enumerate(DDP)},
    "integrations": {"ground", "cuda", "sources", "worker", "engines", "launch", *DDP},
    "bench": {"ground", "cuda", "sources", "worker", "engines", "launch", "distributed", *DDP},
    "top": set(LAYERS),
}

# Layers that must not import torch: "module" (at module level; inside a function is fine) or "any".
NO_TORCH = {"ground": "module", "aggregator": "any"}

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


# --- reading the package -----------------------------------------------------------------------------


@dataclasses.dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (the longest prefix of what was named that is a module)
    line: int
    kind: str  # "module", "function" or "type-checking"


def package_dirs(root: Path) -> dict[str, Path]:
    """Package name -> folder, from pyproject's package-dir (else the package's folder of its name)."""
    dirs = {PACKAGE: root / PACKAGE}
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            import tomllib  # novm: 3.11 and later
        except ImportError:  # Python 3.10: the same parser, as the package tomli
            import tomli as tomllib

        table = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {}).get("package-dir", {})
        dirs.update({name: root / folder for name, folder in table.items() if name.split(".")[0] == PACKAGE})
    return {name: path for name, path in dirs.items() if path.is_dir()}


def find_modules(root: Path) -> dict[str, Module]:
    """Every module of the package, by dotted name."""
    modules: dict[str, Module] = {}
    for pkg, folder in sorted(package_dirs(root).items()):
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            name = ".".join([pkg, *(p for p in rel.parts if p != "__init__")])
            text = path.read_text()
            modules[name] = Module(name, path, path.name == "__init__.py", ast.parse(text, str(path)),
                                   len(text.splitlines()))
    return modules


def layer_of(name: str) -> str:
    """The layer of module ``name``: its longest prefix in :data:`LAYER_OF` (the package itself only
    exactly), else the ground floor."""
    best = max((p for p in LAYER_OF if name == p or (p != PACKAGE and name.startswith(p + "."))), key=len,
               default=None)
    return LAYER_OF[best] if best is not None else "ground"


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines under an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) block."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for child in node.body:
                    lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _function_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lines.update(range(node.lineno + 1 if not isinstance(node, ast.Lambda) else node.lineno,
                               (node.end_lineno or node.lineno) + 1))
    return lines


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from ... import`` (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    base = base if mod.is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(mod: Module, known: set[str]) -> Iterator[Import]:
    """Every import of a module of the package in ``mod``, wherever it stands."""
    typing_lines, function_lines = _type_checking_lines(mod.tree), _function_lines(mod.tree)
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        kind = ("type-checking" if node.lineno in typing_lines else
                "function" if node.lineno in function_lines else "module")
        for name in named:
            if name != PACKAGE and not name.startswith(PACKAGE + "."):
                if name.split(".")[0] == "torch":
                    yield Import(mod.name, "torch", node.lineno, kind)
            elif name in known and name != mod.name:  # (a module that does not exist is not judged)
                yield Import(mod.name, name, node.lineno, kind)


# --- the rules ---------------------------------------------------------------------------------------


def check_layers(modules: dict[str, Module], edges: list[Import], root: Path) -> list[str]:
    failures = []
    for imp in edges:
        mod = modules[imp.source]
        src = layer_of(imp.source)
        where = f"{_rel(mod.path, root)}:{imp.line}"
        if imp.target == "torch":
            rule = NO_TORCH.get(src)
            if rule == "any" or (rule == "module" and imp.kind != "function"):
                failures.append(f"{where}: {imp.source} ({src}) imports torch"
                                + (" at module level" if rule == "module" else "")
                                + f"; the {src} layer runs without torch: "
                                + ("import it inside the function that needs it" if rule == "module"
                                   else "move the code that needs torch to a higher layer"))
            continue
        dst = layer_of(imp.target)
        if dst == src or dst in MAY_IMPORT[src]:
            continue
        higher = LAYERS.index(dst) > LAYERS.index(src)
        failures.append(
            f"{where}: {imp.source} ({src}) imports {imp.target} ({dst}), "
            + ("a higher layer" if higher else "sideways, which the table does not allow")
            + f" ({imp.kind} import); {src} may import {', '.join(sorted(MAY_IMPORT[src])) or 'nothing else'}: "
            "move what it needs down to a layer it may import, or the importing code up")
    return failures


def check_cycles(modules: dict[str, Module], edges: list[Import], root: Path) -> list[str]:
    graph: dict[str, dict[str, Import]] = {name: {} for name in modules}
    for imp in edges:
        if imp.target in graph:
            graph[imp.source].setdefault(imp.target, imp)
    failures = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = _a_cycle(graph, component)
        steps = "; ".join(f"{_rel(modules[a].path, root)}:{graph[a][b].line} {a} -> {b} ({graph[a][b].kind})"
                          for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True))
        failures.append(f"{_rel(modules[cycle[0]].path, root)}:{graph[cycle[0]][cycle[1 % len(cycle)]].line}: "
                        f"import cycle between {', '.join(cycle)}: {steps}; break it by moving what both need "
                        "into a module lower down (an import inside a function or under TYPE_CHECKING is still "
                        "a cycle)")
    return failures


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                out.append(sorted(component))
    return out


def _a_cycle(graph: dict[str, dict[str, Import]], component: list[str]) -> list[str]:
    """One cycle through the first module of a strongly connected component (breadth first)."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if child in members and child not in parent:
                parent[child] = node
                queue.append(child)
    return component


def check_sizes(modules: dict[str, Module], root: Path) -> list[str]:
    failures = []
    for name, mod in sorted(modules.items()):
        where = _rel(mod.path, root)
        if mod.lines > MAX_MODULE_LINES:
            failures.append(f"{where}:1: module {name} has {mod.lines} lines, more than {MAX_MODULE_LINES}; split it "
                            "into modules of one purpose each")
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - start + 1
                if length > MAX_FUNCTION_LINES:
                    failures.append(f"{where}:{node.lineno}: function {node.name} has {length} lines, more than "
                                    f"{MAX_FUNCTION_LINES}; split it into functions of one step each")
    return failures


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def find_scripts(root: Path) -> dict[str, Module]:
    """Every module of ``scripts/`` by the name the scripts import it by: a script by its file's stem, the
    package beside them (``ombench``) by its dotted name."""
    folder = root / "scripts"
    found: dict[str, Module] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("")
        if "data" in rel.parts:
            continue
        name = ".".join(p for p in rel.parts if p != "__init__")
        text = path.read_text()
        found[name] = Module(name, path, path.name == "__init__.py", ast.parse(text, str(path)), len(text.splitlines()))
    return found


def script_imports(mod: Module, known: set[str]) -> Iterator[Import]:
    """Every import of a module of ``scripts/`` (``known``) in ``mod``, wherever it stands."""
    typing_lines, function_lines = _type_checking_lines(mod.tree), _function_lines(mod.tree)
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            base = node.module or ""
            named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        kind = ("type-checking" if node.lineno in typing_lines else
                "function" if node.lineno in function_lines else "module")
        for name in named:
            target = max((k for k in known if name == k or name.startswith(k + ".")), key=len, default=None)
            if target is not None and target != mod.name:
                yield Import(mod.name, target, node.lineno, kind)


def check_scripts(modules: dict[str, Module], root: Path) -> list[str]:
    """Rule (d): cycles among the scripts, and the package importing none of them."""
    scripts = find_scripts(root)
    known = set(scripts)
    edges = list(dict.fromkeys(imp for mod in scripts.values() for imp in script_imports(mod, known)))
    failures = check_cycles(scripts, edges, root)
    tops = {name.split(".")[0] for name in known}
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                named = [node.module or ""]
            else:
                continue
            for name in named:
                if name.split(".")[0] in tops and name.split(".")[0] != PACKAGE:
                    failures.append(f"{_rel(mod.path, root)}:{node.lineno}: {mod.name} imports {name}, a module of "
                                    "scripts/; the package never imports the scripts: move what it needs into the "
                                    "package")
    return failures


def check(root: Path) -> list[str]:
    """Every failure of the package under ``root``, in the order of the rules."""
    modules = find_modules(root)
    known = set(modules)
    edges = list(dict.fromkeys(imp for mod in modules.values() for imp in imports(mod, known)))  # (once each)
    return (check_layers(modules, edges, root) + check_cycles(modules, edges, root) + check_sizes(modules, root)
            + check_scripts(modules, root))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the repository (default: the one holding this script)")
    args = p.parse_args(argv)
    root = args.root.resolve()
    if not package_dirs(root):
        print(f"check_layers: no {PACKAGE} package under {root}", file=sys.stderr)
        return 2
    failures = check(root)
    for line in failures:
        print(line)
    modules = len(find_modules(root))
    print(f"check_layers: {modules} modules, {len(failures)} failure(s)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
