"""No import cycle anywhere in nemo_serve: every `import` and `from ... import` counts, at the top
of a module, inside a function, or under `if TYPE_CHECKING:` (a type-only cycle still ties the two
modules' designs together). Read with ast, so nothing is imported. `from . import x` depends on
module x where there is one, else on the package's __init__; a submodule's implicit import of its
parent package does not count."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nemo_serve"


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    files = {}
    for f in package.rglob("*.py"):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for module, f in files.items():
        here = module.split(".") if f.name == "__init__.py" else module.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                prefix = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    target = f"{prefix}.{a.name}"
                    deps.add(target if target in files else prefix)
        graph[module] = {d for d in deps if d in files and d != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
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


def test_nemo_serve_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and "nemo_serve.core.engine_core" in graph["nemo_serve.core.core_set"]
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in found
    )


def test_the_finder_sees_type_only_relative_and_function_level_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def lazy():\n    from .sub import b\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import B\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nimport pkg.sub.c\n")
    (pkg / "sub" / "c.py").write_text("from pkg import lazy\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.a", "pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg"}
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    (pkg / "a.py").write_text("")
    (pkg / "__init__.py").write_text("")
    assert cycles(import_graph(pkg)) == []
