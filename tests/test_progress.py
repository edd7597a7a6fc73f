"""Progress lines in a log: a resumed run's skipped items must not make the time estimate look short."""

from __future__ import annotations

import io

from rich.console import Console

from marspec import progress as progress_module


def test_log_estimate_counts_only_items_that_took_time(monkeypatch) -> None:
    clock = iter([0.0, 0.1, 0.2, 60.2, 120.2])  # start, two skipped items, two decodes of 60 s each
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with progress_module.progress(console, "gsm8k", 6, eta=True) as advance:
        advance("q0 plain", skipped=True)
        advance("q0 strict", skipped=True)
        advance("q1 plain")
        advance("q1 strict")
    lines = out.getvalue().splitlines()
    assert lines[0] == "gsm8k: 6 planned"
    assert "left" not in lines[1] and "left" not in lines[2]  # nothing decoded yet: no estimate
    # 60.2 s over one decode, 3 items left: ~3 minutes (counting the skipped items would say ~1.5)
    assert lines[3] == "[3/6] q1 plain  (0:01:00 elapsed, ~0:03:00 left)"
    assert lines[4] == "[4/6] q1 strict  (0:02:00 elapsed, ~0:02:00 left)"
