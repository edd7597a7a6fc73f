"""The plugin's counters in ``vllm serve``'s Prometheus metrics, without pickling anything.

The counters live in the worker that verifies (:data:`.plugin.counters`); ``/metrics`` is served by the
API server, another process. vLLM has no public channel for a plugin's numbers between the two (its
``SchedulerStats`` has fixed fields, and ``collective_rpc`` with a function needs insecure
serialization), so they travel as a small JSON file:

- the API server's process, when it builds the engine config of a deployment with the plugin
  (before vLLM starts its engine processes, which inherit its environment), names a private directory
  in ``MARSPEC_VLLM_METRICS_DIR`` (a fresh ``mkdtemp``, mode 0700, unless the variable is already set);
- the worker (tensor-parallel rank 0) writes its per-rule totals there after every verification step
  (:class:`CounterFile`: ``counters-<pid>.json``, replaced atomically; ~30 microseconds a step in
  ``/dev/shm``, where the directory goes when the system has it);
- the API server reads the files when Prometheus scrapes (:func:`read_counter_files`, summed over the
  engines' workers): :class:`~.stat_logger.MarspecStatLogger`, a vLLM stat logger plugin (entry point
  group ``vllm.stat_logger_plugins``), registers a collector for them.

Only numbers cross the process boundary, as JSON. Free of vLLM imports.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

from marspec.integrations.vllm.batch_rule import COUNTER_NAMES

METRICS_DIR_VARIABLE = "MARSPEC_VLLM_METRICS_DIR"
_PATTERN = "counters-*.json"


def prepare_metrics_dir() -> Path:
    """The directory the worker writes its counters to, named in the environment for vLLM's engine
    processes to inherit: ``$MARSPEC_VLLM_METRICS_DIR`` when set, else a fresh private one, removed when
    this process exits."""
    named = os.environ.get(METRICS_DIR_VARIABLE)
    if named:
        return Path(named)
    # In memory where the system has it: a disk-backed write took ~0.2 ms (p90 ~4 ms on a busy disk),
    # one in /dev/shm ~0.03 ms, and the worker writes after every step.
    memory = Path("/dev/shm")
    created = tempfile.mkdtemp(prefix="marspec-vllm-metrics-", dir=memory if memory.is_dir() else None)
    atexit.register(shutil.rmtree, created, ignore_errors=True)
    os.environ[METRICS_DIR_VARIABLE] = created
    return Path(created)


class CounterFile:
    """One worker's counters file, rewritten whole (write, then atomic rename) so a reader never sees
    half of it."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / f"counters-{os.getpid()}.json"
        self._staging = self.path.with_suffix(".tmp")

    def write(self, by_rule: dict[str, dict[str, int]]) -> None:
        """Replace the file's content with ``by_rule`` (rule name -> counter name -> total)."""
        self._staging.write_text(json.dumps(by_rule))
        os.replace(self._staging, self.path)


def read_counter_files(directory: str | os.PathLike[str]) -> dict[str, dict[str, int]]:
    """The workers' totals in ``directory``, summed per rule name and counter."""
    totals: dict[str, dict[str, int]] = {}
    for path in sorted(Path(directory).glob(_PATTERN)):
        try:
            by_rule = json.loads(path.read_text())
        except (OSError, ValueError):  # removed between the listing and the read
            continue
        for rule, counts in by_rule.items():
            mine = totals.setdefault(rule, dict.fromkeys(COUNTER_NAMES, 0))
            for name in COUNTER_NAMES:
                mine[name] += int(counts.get(name, 0))
    return totals


# Prometheus counters: name (vLLM's "vllm:" style, with marspec's prefix), counter, help text.
PROMETHEUS_COUNTERS = (
    ("marspec:verification_blocks", "steps", "Verification blocks (a request's drafts in one step) verified"),
    ("marspec:draft_tokens", "drafted", "Draft tokens the plugin verified"),
    ("marspec:accepted_exact_tokens", "accepted_exact", "Draft tokens accepted as the target's own choice"),
    (
        "marspec:accepted_relaxed_tokens",
        "accepted_relaxed",
        "Draft tokens accepted by the rule's relaxation (a close call), not by the lossless test",
    ),
    ("marspec:rejected_blocks", "rejected", "Verification blocks that ended in a rejected draft token"),
)
