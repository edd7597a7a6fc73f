"""The bar the project keeps for its own code, checked on every module: a function fits on a screen
(at most 80 lines, benchmarks' ``main``s included), every module says what it is for in a docstring, and
every benchmark is named in benchmarks/README.md (what it answers, its command, where its results are).
Read from the source (``ast``), so it costs a second."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = (ROOT / "src" / "marspec", ROOT / "benchmarks")
MAX_FUNCTION_LINES = 80


def modules() -> list[Path]:
    return sorted(path for folder in CHECKED for path in folder.rglob("*.py"))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function or method of ``source`` longer than ``limit`` lines,
    from its ``def`` to its last line (a nested function counts in its own right and in its parent's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def test_no_function_is_longer_than_80_lines() -> None:
    paths = modules()
    assert len(paths) > 100  # src and benchmarks were read
    over = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in paths
        for name, line, length in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(over)


def test_the_length_check_counts_a_function_whole() -> None:
    def function(name: str, body_lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(body_lines))

    assert long_functions(function("fits", 79)) == []  # 80 lines with its def
    method = "class C:\n" + textwrap.indent(function("long", 80), "    ")
    assert long_functions(method) == [("long", 2, 81)]


def test_every_module_has_a_docstring() -> None:
    missing = [
        str(path.relative_to(ROOT))
        for path in modules()
        if ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) is None
    ]
    assert not missing, "modules without a docstring saying what they are for:\n" + "\n".join(missing)


def test_every_benchmark_is_named_in_the_benchmarks_readme() -> None:
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p for pattern in ("*.py", "*.sh") for p in (ROOT / "benchmarks").glob(pattern))
    assert any(p.name == "engines.py" for p in scripts)
    unnamed = [p.name for p in scripts if f"]({p.name})" not in readme and f"`{p.name}`" not in readme]
    assert not unnamed, "benchmarks/README.md names no row for: " + ", ".join(unnamed)
