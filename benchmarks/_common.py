"""What the benchmark scripts share: one way to time a call, to write a result with the machine it came
from, and to declare the arguments most of them take.

Not a benchmark: the scripts import it as ``_common`` (``python benchmarks/NAME.py`` puts this folder on
the path). torch and marspec are imported where they are used, so a script that needs neither (the
llama.cpp side, run in an environment of its own) could still import this module.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows the script's docstring as written (its commands too)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_threads(parser: argparse.ArgumentParser, default: int = 2) -> None:
    """``--threads``: torch's CPU threads (2 by default: the cores the committed CPU runs had)."""
    parser.add_argument("--threads", type=int, default=default, help=f"CPU threads (default {default})")


def device_sync(device: Any) -> None:
    """Wait for a torch device's queued work (a no-op on the CPU, whose torch calls return when done)."""
    waiter(device)()


def waiter(device: Any) -> Callable[[], None]:
    """What waits for ``device``'s queued work, decided once (a timed loop then pays no lookup)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def median_ms(
    call: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 0,
    device: Any = "cpu",
    after: Callable[[], object] | None = None,
) -> float:
    """Median wall milliseconds of ``repeats`` calls of ``call``, after ``warmup`` calls that are not
    timed. Each timed call is bracketed by a synchronisation of ``device``, so a GPU's queued kernels
    are counted and not only their launch; ``after`` (a rollback, say) runs after every call, untimed."""
    for _ in range(warmup):
        call()
        if after is not None:
            after()
    wait = waiter(device)
    samples = []
    for _ in range(repeats):
        wait()
        start = time.perf_counter()
        call()
        wait()
        samples.append(1000 * (time.perf_counter() - start))
        if after is not None:
            after()
    return statistics.median(samples)


def decode_rates(stats: Sequence[Any]) -> dict[str, float]:
    """Decodes' tokens a second, tokens a verification, and a draft forward's milliseconds (0 where none
    ran), over their :class:`~marspec.stats.GenerationStats` together."""
    new_tokens, drafted = sum(s.new_tokens for s in stats), sum(s.draft_forwards for s in stats)
    return {
        "tokens_per_s": new_tokens / sum(s.wall_s for s in stats),
        "tokens_per_verification": new_tokens / sum(s.target_forwards for s in stats),
        "draft_ms_per_forward": 1000 * sum(s.draft_forward_s for s in stats) / max(drafted, 1),
    }


def git_commit() -> str | None:
    """The commit of the checkout this folder is in, or None outside one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def machine() -> dict[str, Any]:
    """Where and with what a result was measured: the processor, torch's threads, the versions, the
    commit and the date (speed ratios between processors are not measurements, so every result names
    its own)."""
    import torch

    import marspec
    from marspec.eval.cpu import cpu_name

    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": {
            "marspec": marspec.__version__,
            "commit": git_commit(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def write_json(path: Path | str, result: object) -> None:
    """Write ``result`` to ``path`` as indented JSON ending in a newline (the whole file, each time: a
    script that writes after each part keeps what a cut run measured)."""
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def add_scheduler_ab_args(parser: argparse.ArgumentParser, rounds: int = 4, tokens: int = 128) -> None:
    """``--rounds`` and ``--max-new-tokens`` of :func:`scheduler_ab` (runs per arm, tokens per answer)."""
    for flag, default in (("--rounds", rounds), ("--max-new-tokens", tokens)):
        parser.add_argument(flag, type=int, default=default, help=f"default {default}")


@contextlib.contextmanager
def forwards_timed() -> Iterator[list[float]]:
    """The batch scheduler's gathered forwards timed while inside: yields a one-item list whose item adds
    up their seconds (set it to 0 to start a count)."""
    import marspec.batch.scheduler as batch_scheduler

    run_group = batch_scheduler.run_group
    seconds = [0.0]

    def timed(requests: Any) -> Any:
        start = time.perf_counter()
        try:
            return run_group(requests)
        finally:
            seconds[0] += time.perf_counter() - start

    batch_scheduler.run_group = timed  # type: ignore[assignment]
    try:
        yield seconds
    finally:
        batch_scheduler.run_group = run_group


def scheduler_ab(
    arms: dict[str, Callable[[], None]], clients: int, rounds: int, max_new_tokens: int
) -> dict[str, Any]:
    """``clients`` sequences decoding the demo's prompts (each client all of them in turn, strict, the
    default pair on 2 threads) through the batch scheduler, no HTTP, once per arm in each of ``rounds``
    rounds, the arms' order alternating; an arm is a function that puts the process in its state before
    its run. Per run: aggregate tok/s, the seconds in the batch's gathered forwards and the rest (the
    sequences' own work between forwards); the medians per arm; whether every prompt got one answer
    across all runs."""
    import marspec
    from marspec.batch.many import relay
    from marspec.batch.scheduler import Scheduler
    from marspec.demo import DEMO_PROMPTS
    from marspec.settings import GenerationOptions

    decoder = marspec.Decoder(threads=2)
    prompts = [[{"role": "user", "content": text}] for _, text in DEMO_PROMPTS]
    decoder.generate(prompts[0], max_new_tokens=8)  # warm-up, and the kernels' library loaded
    tokens = [0]

    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    answers: dict[int, set[tuple[int, ...]]] = defaultdict(set)

    def work(i: int) -> Callable[[Any], Any]:
        def run(slot: Any) -> Any:
            for j in range(len(prompts)):
                options = GenerationOptions.of({"max_new_tokens": max_new_tokens, "rule": "strict"})
                steps = decoder.decode_on(slot, prompts[(i + j) % len(prompts)], options, True)
                end = yield from relay(steps, lambda _: True)
                tokens[0] += len(end.token_ids)
                answers[(i + j) % len(prompts)].add(tuple(end.token_ids))

        return run

    with forwards_timed() as forwards:
        for round_ in range(rounds):
            for arm in list(arms) if round_ % 2 == 0 else list(arms)[::-1]:
                arms[arm]()
                tokens[0], forwards[0] = 0, 0.0
                scheduler = Scheduler(decoder.target, decoder.drafter, max_batch=8)
                for i in range(clients):
                    scheduler.add(work(i))
                start = time.perf_counter()
                while scheduler.step():
                    pass
                wall = time.perf_counter() - start
                scheduler.close()
                run = {"tok_s": tokens[0] / wall, "forwards_s": forwards[0], "rest_s": wall - forwards[0]}
                runs[arm].append(run)
                print(arm, {k: round(v, 2) for k, v in runs[arm][-1].items()}, flush=True)
    summary = {arm: {k: statistics.median(r[k] for r in v) for k in v[0]} for arm, v in runs.items()}
    return {
        "clients": clients,
        "runs": runs,
        "medians": summary,
        "one_answer_per_prompt": all(len(s) == 1 for s in answers.values()),
    }
