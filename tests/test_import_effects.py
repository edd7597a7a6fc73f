"""Importing marspec changes nothing global: no environment variable, no torch thread count.

Checked in a fresh interpreter (this one imported everything long ago), after torch and transformers
themselves are imported, so that only what marspec's own import does is seen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = """
import json, os
import torch, transformers
# Their own import-time effects are not marspec's: loading transformers' models module, for one, has
# torch's inductor set TORCHINDUCTOR_CACHE_DIR.
from transformers import PreTrainedModel

def state():
    return dict(os.environ), torch.get_num_threads(), torch.get_num_interop_threads()

env, threads, interop = state()
import marspec, marspec.api, marspec.backends.hf, marspec.models, marspec.selftest, marspec.cli
after_env, after_threads, after_interop = state()
changed = sorted(k for k in env.keys() | after_env.keys() if env.get(k) != after_env.get(k))
seen = {"changed": changed, "threads": [threads, after_threads], "interop": [interop, after_interop]}
print(json.dumps(seen))
"""


def test_importing_marspec_changes_no_environment_variable_and_no_thread_count():
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)  # what marspec's import used to set
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["changed"] == []
    assert seen["threads"][0] == seen["threads"][1] and seen["interop"][0] == seen["interop"][1]
