"""marspec's modules import one another without a circle.

Every import statement counts, wherever it stands: at module level, under ``if TYPE_CHECKING:`` (a
circle of type-only imports still ties the modules' designs together, and type checkers must untangle
it) and inside functions (a late import that closes a circle only hides it). An edge goes to the module
an import names; ``from package import name`` goes to the submodule when ``name`` is one, else to the
package. Parent packages a dotted import runs first are not edges (every module would import its
package's ``__init__``).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "marspec") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, for every module under ``root / package``."""
    paths = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # the importing package
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up level - 1 packages from the importing package
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for target in wanted:
                while target and target not in paths:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as ``[a, b, ..., a]``, or None when it has none (depth-first search: a
    directed graph has a circle exactly when the search meets a module still on its path)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_marspec_has_no_import_circle():
    graph = import_graph(SRC)
    assert "marspec.interfaces" in graph and graph["marspec.decode"]  # the whole package was read
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_shared_types_import_nothing_of_marspec():
    assert import_graph(SRC)["marspec.interfaces"] == set()


def test_a_planted_type_checking_circle_is_found(tmp_path):
    # The circle this check was written against: the backend protocol naming the tree type, the tree
    # naming the draft, the drafter protocol naming the backend; here planted again, type-only.
    shutil.copytree(SRC / "marspec", tmp_path / "marspec")
    interfaces = tmp_path / "marspec" / "interfaces.py"
    interfaces.write_text(
        interfaces.read_text() + "\nif TYPE_CHECKING:\n    from marspec.drafters.tree import build_tree\n"
    )
    cycle = find_cycle(import_graph(tmp_path))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"marspec.interfaces", "marspec.drafters.tree"} <= set(cycle)


def test_relative_and_late_imports_are_edges_too(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import g\n")
    (pkg / "b.py").write_text("from pkg.sub.a import f\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub"] == {"pkg.sub.a"} and graph["pkg.sub.a"] == {"pkg.b"}
    assert find_cycle(graph) == ["pkg.b", "pkg.sub.a", "pkg.b"]


def test_the_public_paths_of_the_moved_types_still_work():
    import marspec
    from marspec import backends, drafters, interfaces, tree

    assert marspec.DraftTree is tree.DraftTree is interfaces.DraftTree
    assert backends.CausalLM is interfaces.CausalLM and backends.ForwardClock is interfaces.ForwardClock
    assert drafters.Draft is interfaces.Draft and drafters.Drafter is interfaces.Drafter
    assert tree.build_tree is drafters.tree.build_tree
