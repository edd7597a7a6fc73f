"""``marspec selftest``: does marspec decode correctly on this machine and device?

In seconds, with small random-weight models built here (nothing is downloaded, no weights ship with
marspec), on the chosen device:

- **strict equals plain**: strict verification, as a draft chain and as a token tree, emits exactly the
  tokens plain greedy decoding emits (and the drafts were really accepted and rejected, so the check is
  not vacuous);
- **rules that cannot relax equal strict**: MARS at theta = 1 (both ratio margins), FLy above its
  largest possible entropy, and MARS at theta = 1 under the class guard;
- **speculative sampling is lossless**: a chi-square test of the joint distribution of the first tokens
  that strict speculative sampling emits (draft model sampling, verification, residual and bonus draws,
  the caches), against the target's exact distribution computed from its own forwards;
- **fixed shapes == eager**: the fixed-shape path (``graphs="on"``) decodes the eager path's tokens
  (plain, strict chain and tree, a relaxing MARS); on CUDA its forwards are captured as CUDA graphs, and
  every capture's replay must equal its uncaptured forward bit for bit;
- **one device read per step**: every host read of a device tensor (``.cpu()``, ``.item()``,
  ``.tolist()``, ``int()``, ``bool()``, data-dependent shapes such as ``nonzero``) is counted while the
  loop runs; each verification step must make exactly one (its read-back), whichever rule (MARS,
  MARS with the class guard, FLy's deferral), sampling or tree. On the CPU, where every tensor is a
  host tensor, the models' outputs stand for device tensors (they and everything computed from them
  are counted), as ``tests/test_decode.py`` does.

It needs only marspec, torch and transformers. :func:`run_selftest` returns a :class:`SelftestReport`;
the CLI (``marspec selftest``) prints it and exits non-zero when a check fails. The parts:
:mod:`~marspec.selftest.tiny` (the models), :mod:`~marspec.selftest.equality`,
:mod:`~marspec.selftest.sampling`, :mod:`~marspec.selftest.reads` and :mod:`~marspec.selftest.fixed`
(the checks),
:mod:`~marspec.selftest.environment`, :mod:`~marspec.selftest.report` (the results).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from marspec.devices import resolve_device
from marspec.selftest.engines import (
    batch_decodes_as_alone,
    fixed_batch_decodes_as_alone,
    int8_engine_keeps_the_invariants,
    q4k_engine_keeps_the_invariants,
)
from marspec.selftest.environment import environment
from marspec.selftest.equality import (
    compare_runs,
    first_difference,
    no_relax_equals_strict,
    strict_equals_plain,
)
from marspec.selftest.fixed import fixed_equals_eager
from marspec.selftest.reads import HostReads, one_read_per_step, reads_per_step
from marspec.selftest.report import Check, SelftestReport
from marspec.selftest.sampling import chi_square, sampled_counts, sampling_is_lossless, target_joint
from marspec.selftest.tiny import save_tiny_model, tiny_decoder, tiny_model, tiny_tokenizer

__all__ = [
    "Check",
    "HostReads",
    "SelftestReport",
    "batch_decodes_as_alone",
    "chi_square",
    "compare_runs",
    "environment",
    "first_difference",
    "fixed_batch_decodes_as_alone",
    "fixed_equals_eager",
    "int8_engine_keeps_the_invariants",
    "no_relax_equals_strict",
    "one_read_per_step",
    "q4k_engine_keeps_the_invariants",
    "reads_per_step",
    "run_selftest",
    "sampled_counts",
    "sampling_is_lossless",
    "save_tiny_model",
    "strict_equals_plain",
    "target_joint",
    "tiny_decoder",
    "tiny_model",
    "tiny_tokenizer",
]


def run_selftest(device: str | torch.device = "auto", threads: int | None = 1) -> SelftestReport:
    """Run every check on ``device`` ("auto", "cpu", "cuda", "cuda:N" or "mps"; a missing device is a
    one-line MarspecError). ``threads``: torch's thread count while the checks run on the CPU (1 by
    default: the models are tiny, and more threads only add contention), restored afterwards."""
    where = resolve_device(device)
    start = time.perf_counter()
    on_cpu = where.type == "cpu"
    with _threads(threads if on_cpu else None), tempfile.TemporaryDirectory() as tmp:
        used = torch.get_num_threads()
        decoder = tiny_decoder(Path(tmp), where)
        checks = (
            strict_equals_plain(decoder),
            no_relax_equals_strict(decoder),
            sampling_is_lossless(where),
            one_read_per_step(decoder),
            fixed_equals_eager(decoder, tiny_decoder(Path(tmp), where, graphs="on")),
            int8_engine_keeps_the_invariants(Path(tmp), where),
            q4k_engine_keeps_the_invariants(Path(tmp), where),
            batch_decodes_as_alone(Path(tmp), where),
            fixed_batch_decodes_as_alone(Path(tmp), where),
        )
        checks = tuple(check for check in checks if check is not None)
    env = environment(where)
    if on_cpu:
        env["torch threads"] = f"{used} for the checks ({env['torch threads']} in this process otherwise)"
    return SelftestReport(str(where), checks, env, time.perf_counter() - start)


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's (process-wide) thread count set to ``count`` for the block, then put back."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
