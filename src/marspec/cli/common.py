"""What every command shares: the app, the error channel, the settings that travel to the library, and
the model loader."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.text import Text

from marspec.errors import MarspecError
from marspec.load_settings import LoadSettings
from marspec.progress import status

if TYPE_CHECKING:
    from marspec.api import Decoder

app = typer.Typer(
    help="Speculative decoding with margin-aware verification (MARS).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Messages name paths, models and install commands (`pip install 'marspec[serve]'`): text in square
# brackets is theirs, not rich markup, so this console prints every string as it is. Styles are given as
# rich Text or style= arguments.
err = Console(stderr=True, markup=False)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a MarspecError into one line on stderr and exit status 2."""
    try:
        yield
    except MarspecError as exc:
        err.print(Text.assemble(("error:", "bold red"), f" {exc}"), highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None


def load_decoder(
    target: str, draft: str | None, dtype: str, threads: int | None, settings: LoadSettings
) -> Decoder:
    """The library's :func:`marspec.api.load_decoder` (the last pair loaded is reused) under a spinner,
    with a Hub model's tokenizer checked and its download shown before the weights load."""
    from marspec.api import check_same_tokenizer, loaded_decoder
    from marspec.api import load_decoder as load
    from marspec.models import resolve_model_dir
    from marspec.models.hub import names_hub_model

    held = loaded_decoder(target, draft, dtype, threads, settings)
    if held is not None:
        return held
    hub = [name for name in (target, draft) if name and names_hub_model(name)]
    if hub and draft not in (None, "none", "ngram"):
        check_same_tokenizer(target, draft)  # before downloading gigabytes of weights (Decoder checks too)
    for name in hub:  # a download's progress bars show before the spinner, not under it
        resolve_model_dir(name)
    with status(err, f"loading {target}" + (f" and {draft}" if draft and draft != "none" else "")):
        return load(target, draft, dtype, threads, settings)


def print_summary(summary: dict[str, Any], out: Path) -> None:
    """A finished benchmark's summary table on stdout and where its folder is on stderr."""
    from marspec.eval.render import summary_markdown

    Console().print(summary_markdown(summary))
    err.print(f"results in {out}")


__all__ = ["LoadSettings", "app", "err", "load_decoder", "print_summary", "user_errors"]
