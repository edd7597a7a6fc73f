"""A new user's first 4-bit load of the default pair, and a later one: seconds, and how many of them went to
parsing GGUF headers (gguf's ``GGUFReader``, ~13 s a Qwen2.5 header on a 2-core CPU).

    python benchmarks/first_load.py
    PYTHONPATH=/path/to/other/marspec/src python benchmarks/first_load.py   # another version, to compare

The first load prepares a fresh model cache (in a temporary folder, removed afterwards) from the packaged
GGUFs, as a new user's first ``Decoder(..., target_quant="int4", draft_quant="int4")`` does; the second
loads from that cache. Run versions one after another on a quiet machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import script_parser  # this folder's shared helpers


def main() -> None:
    script_parser(__doc__).parse_args()
    import gguf

    parses = {"count": 0, "seconds": 0.0}
    parse = gguf.GGUFReader.__init__

    def counted(self: gguf.GGUFReader, *args: object, **kwargs: object) -> None:
        started = time.perf_counter()
        parse(self, *args, **kwargs)
        parses["count"] += 1
        parses["seconds"] += time.perf_counter() - started

    gguf.GGUFReader.__init__ = counted  # this script's own process: it measures, nothing else runs here
    cache = Path(tempfile.mkdtemp(prefix="marspec-first-load-"))
    os.environ["MARSPEC_CACHE_DIR"] = str(cache)
    try:
        import marspec
        from marspec.api import Decoder
        from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

        print(f"marspec {marspec.__version__} from {Path(marspec.__file__).parent}")
        for which in ("first load (fresh cache)", "later load"):
            before = dict(parses)
            started = time.perf_counter()
            Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", target_quant="int4", draft_quant="int4")
            seconds = time.perf_counter() - started
            count, parsing = parses["count"] - before["count"], parses["seconds"] - before["seconds"]
            print(f"{which}: {seconds:.1f} s, of which {count} GGUF header parses took {parsing:.1f} s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
