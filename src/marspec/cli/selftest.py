"""``selftest``: check that marspec decodes correctly on this machine and device (:mod:`marspec.selftest`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from marspec.cli.common import app, err, user_errors
from marspec.errors import MarspecError

if TYPE_CHECKING:
    from marspec.selftest import SelftestReport

ACCELERATORS = ("cuda", "mps")


@app.command()
def selftest(
    device: Annotated[
        str, typer.Option("--device", help="auto | cpu | cuda | cuda:N | mps (auto: a GPU if there is one).")
    ] = "auto",
    threads: Annotated[
        int, typer.Option("--threads", help="torch threads for the CPU checks (tiny models: 1 is fastest).")
    ] = 1,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the report as JSON to this file.")
    ] = None,
) -> None:
    """Check, in seconds and with tiny random models built here, that strict == plain, MARS, FLy and the
    class guard at settings that cannot relax == strict, speculative sampling is lossless and each step
    reads the device once; print the environment. Exits 1 when a check fails."""
    from marspec.selftest import run_selftest

    with user_errors():
        if threads < 1:
            raise MarspecError(f"--threads must be >= 1, got {threads}")
        report = run_selftest(device, threads=threads)
        if json_path is not None:
            try:
                json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
            except OSError as exc:
                raise MarspecError(
                    f"cannot write {json_path} ({exc.strerror}): pick a writable path"
                ) from None
    print_report(report, Console())
    if not report.passed:
        raise typer.Exit(1)


def print_report(report: SelftestReport, console: Console) -> None:
    """The verdict table (with the devices not checked by this run), then the environment."""
    verdicts = Table(title=f"marspec selftest on {report.device} ({report.seconds:.1f} s)")
    for column in ("check", "result", "detail"):
        verdicts.add_column(column, overflow="fold")
    for check in report.checks:
        result = "[green]PASS[/]" if check.passed else "[bold red]FAIL[/]"
        verdicts.add_row(check.name, result, check.detail)
    ran = report.device.partition(":")[0]
    for other in (d for d in ("cpu", *ACCELERATORS) if d != ran):
        verdicts.add_row(f"on {other}", "not run here", f"marspec selftest --device {other}")
    console.print(verdicts)
    env = Table(title="environment", show_header=False)
    env.add_column("what", style="bold")
    env.add_column("value", overflow="fold")
    for key, value in report.environment.items():
        env.add_row(key, value)
    console.print(env)
    verdict = "all checks passed" if report.passed else "a check FAILED"
    err.print(f"marspec selftest: {verdict}", highlight=False)
