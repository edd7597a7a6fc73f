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
import sys
from collections.abc import Callable
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


def test_the_shared_types_have_one_public_path_each():
    import marspec
    from marspec import backends, drafters, interfaces

    assert marspec.DraftTree is interfaces.DraftTree
    assert backends.CausalLM is interfaces.CausalLM and backends.ForwardClock is interfaces.ForwardClock
    assert drafters.Draft is interfaces.Draft and drafters.Drafter is interfaces.Drafter


# ------------------------------------------------------------------- settling a generation never climbs


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Module -> its layer: 0 for a module importing nothing of marspec, else one above the highest module
    it imports (the graph has no circle, so this is well defined)."""
    rank: dict[str, int] = {}

    def of(module: str) -> int:
        if module not in rank:
            rank[module] = 1 + max((of(m) for m in graph.get(module, ())), default=-1)
        return rank[module]

    for module in graph:
        of(module)
    return rank


def below(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = list(graph.get(module, ()))
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def call_edges(entry: Callable[[], object]) -> list[tuple[str, str]]:
    """The calls from one marspec module into another while ``entry`` runs, in order (caller, callee)."""
    edges: list[tuple[str, str]] = []

    def profile(frame, event, arg) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if callee != caller and callee.startswith("marspec.") and caller.startswith("marspec."):
            edges.append((caller, callee))

    sys.setprofile(profile)
    try:
        entry()
    finally:
        sys.setprofile(None)
    return edges


def climbs(graph: dict[str, set[str]], edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The calls that go up: into a module that imports the caller (a callback, or a lower module
    reaching back into a higher one for part of the work)."""
    return [(caller, callee) for caller, callee in edges if caller in below(graph, callee)]


def settle_entry_points(calibration_dir: Path) -> dict[str, Callable[[], object]]:
    """Each entry point's settling of a generation, free of models (a Pair can be named before loading):
    the library (and through it the CLI and the server), the server's request parsing, the bench's
    methods and run, and the vLLM plugin's configuration. ``theta="auto"`` reads a calibration stored in
    ``calibration_dir``."""
    import os

    from marspec.calibration import Choice, save_choice
    from marspec.eval.methods import parse_methods
    from marspec.integrations.vllm.config import parse_plugin_config
    from marspec.serve.schemas import ChatCompletionRequest, parse_request
    from marspec.serve.settings import ServerSettings
    from marspec.settings import GenerationOptions, Pair, settle

    os.environ["MARSPEC_CALIBRATION_DIR"] = str(calibration_dir)
    save_choice("t", "d", Choice("logit_ratio", 0.9, 0.99, True, "", 0.0, {}))
    pair = Pair("t", "d")
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], marspec={"rule": "mars", "theta": "auto"}
    )
    return {
        "library": lambda: settle(GenerationOptions(rule="mars", theta="auto", tree="2,2"), pair),
        "library, strict": lambda: settle(GenerationOptions(), pair),
        "server request": lambda: settle(
            parse_request(
                request, ServerSettings(model_name="m"), context_length=0, has_drafter=True
            ).options,
            pair,
        ),
        "bench methods": lambda: parse_methods("mars,mars-gap@2+class,topk@3,fly-w4@0.3", 0.5),
        "vllm plugin": lambda: parse_plugin_config({"marspec": {"rule": "fly", "theta": 0.3}}),
    }


def settle_report(calibration_dir: Path) -> tuple[str, int]:
    """A listing of the calls each entry point's settling makes between modules, with each module's
    layer, and the number of climbs among them."""
    graph = import_graph(SRC)
    rank = layers(graph)
    lines, total = [], 0
    for name, entry in settle_entry_points(calibration_dir).items():
        edges = list(dict.fromkeys(call_edges(entry)))  # distinct, in first-call order
        up = climbs(graph, edges)
        total += len(up)
        modules = sorted({m for edge in edges for m in edge}, key=lambda m: -rank[m])
        lines.append(f"{name}: {len(modules)} modules, {len(up)} climbs")
        lines.append("  layers: " + ", ".join(f"{m.removeprefix('marspec.')} {rank[m]}" for m in modules))
        for caller, callee in edges:
            mark = "  CLIMB" if (caller, callee) in up else ""
            lines.append(f"  {caller.removeprefix('marspec.')} -> {callee.removeprefix('marspec.')}{mark}")
    return "\n".join(lines), total


def test_settling_a_generation_never_climbs(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSPEC_CALIBRATION_DIR", str(tmp_path))  # restored after the test
    report, total = settle_report(tmp_path)
    assert total == 0, report
    assert "settings -> calibration" in report and "settings -> rules" in report  # the paths were traced


def test_a_planted_callback_is_a_climb():
    graph = {"hi": {"lo"}, "lo": set()}
    assert climbs(graph, [("hi", "lo"), ("lo", "hi")]) == [("lo", "hi")]
    assert layers(graph) == {"hi": 1, "lo": 0}


if __name__ == "__main__":  # python tests/test_import_graph.py: the listing the settle test checks
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        text, count = settle_report(Path(folder))
    print(text)
    print(f"climbs in all: {count}")
    sys.exit(0 if count == 0 else 1)
