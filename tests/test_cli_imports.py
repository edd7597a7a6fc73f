"""The command line answers ``--help`` and argument errors without importing torch or transformers.

Checked in a fresh interpreter (this one imported everything long ago): every command's help, an unknown
option, and the settings the CLI refuses before loading weights (a bad rule or theta) must come from the
light modules alone, so they answer at once instead of after seconds of imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = """
import json, sys
import typer
from typer.testing import CliRunner
from marspec.cli import app

HEAVY = ("torch", "transformers")
runner = CliRunner()
commands = sorted(typer.main.get_command(app).commands)
calls = [["--help"], *([name, "--help"] for name in commands)]
calls += [[name, "--no-such-option"] for name in commands]
calls += [
    ["generate", "hi", "--rule", "bogus"],
    ["generate", "hi", "--rule", "mars", "--theta", "5"],
    ["demo", "--theta", "7"],
    ["serve", "--rule", "bogus"],
    ["serve", "--log-level", "loud"],
]
seen = []
for args in calls:
    result = runner.invoke(app, args)
    heavy = [m for m in HEAVY if m in sys.modules]
    seen.append({"args": args, "code": result.exit_code, "out": result.output, "heavy": heavy})
print(json.dumps({"commands": commands, "calls": seen}))
"""


def run_cli_calls() -> dict:
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_and_argument_errors_import_neither_torch_nor_transformers():
    seen = run_cli_calls()
    assert {"generate", "serve", "bench", "demo", "calibrate"} <= set(seen["commands"])
    for call in seen["calls"]:
        args = call["args"]
        assert call["heavy"] == [], f"marspec {' '.join(args)} imported {call['heavy']}"
        if args[-1] == "--help":
            assert call["code"] == 0 and "Usage:" in call["out"], call
        else:
            assert call["code"] == 2, call
    refused = {" ".join(c["args"]): c["out"] for c in seen["calls"] if "--no-such-option" not in c["args"]}
    assert "unknown rule 'bogus'" in refused["generate hi --rule bogus"]
    assert "theta=5.0 is invalid" in refused["generate hi --rule mars --theta 5"]
    assert "theta=7.0 is invalid" in refused["demo --theta 7"]
    assert "unknown rule 'bogus'" in refused["serve --rule bogus"]
    assert "unknown --log-level 'loud'" in refused["serve --log-level loud"]
