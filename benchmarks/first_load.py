"""A new user's first load of the default pair, and a later one: seconds, and how many of them went to
parsing GGUF headers (gguf's ``GGUFReader``).

    python benchmarks/first_load.py                                   # the default engine (q4k on a CPU)
    MARSPEC_DRAFT_COSTS=off python benchmarks/first_load.py --built-kernels   # the load alone
    python benchmarks/first_load.py --engine int4                     # the 4-bit target and draft
    python benchmarks/first_load.py --engine int8                     # the int8 target, 4-bit draft
    PYTHONPATH=/path/to/other/marspec/src python benchmarks/first_load.py   # another version, to compare

The first load prepares a fresh model cache (in a temporary folder, removed afterwards) from the packaged
GGUFs, as a new user's first ``Decoder(DEFAULT_TARGET, DEFAULT_DRAFT)`` does (``--engine int4``:
``target_quant="int4", draft_quant="int4"``; ``--engine int8``, the default where the Q4_K kernel does
not run: ``target_quant="int8", draft_quant="int4"``), building the CPU kernels too unless ``--built-kernels``
copies the ones this user's cache holds; the second loads from that cache. Where the draft length is
chosen from the machine's costs, the first load measures them unless ``MARSPEC_DRAFT_COSTS=off``. Run
versions one after another on a quiet machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import script_parser  # this folder's shared helpers


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--engine", choices=["default", "int4", "int8"], default="default")
    parser.add_argument("--built-kernels", action="store_true", help="copy this cache's built kernels first")
    args = parser.parse_args()
    import gguf

    from marspec.models.cache import cache_dir

    parses = {"count": 0, "seconds": 0.0}
    parse = gguf.GGUFReader.__init__

    def counted(self: gguf.GGUFReader, *args: object, **kwargs: object) -> None:
        started = time.perf_counter()
        parse(self, *args, **kwargs)
        parses["count"] += 1
        parses["seconds"] += time.perf_counter() - started

    gguf.GGUFReader.__init__ = counted  # this script's own process: it measures, nothing else runs here
    cache = Path(tempfile.mkdtemp(prefix="marspec-first-load-"))
    if args.built_kernels and (cache_dir() / "kernels").is_dir():
        shutil.copytree(cache_dir() / "kernels", cache / "kernels")
    options = {
        "default": {},
        "int4": {"dtype": "fp32", "target_quant": "int4", "draft_quant": "int4"},
        "int8": {"target_quant": "int8", "draft_quant": "int4"},
    }[args.engine]
    os.environ["MARSPEC_CACHE_DIR"] = str(cache)
    try:
        import marspec
        from marspec.api import Decoder
        from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

        print(f"marspec {marspec.__version__} from {Path(marspec.__file__).parent}")
        for which in ("first load (fresh cache)", "later load"):
            before = dict(parses)
            started = time.perf_counter()
            Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, **options)
            seconds = time.perf_counter() - started
            count, parsing = parses["count"] - before["count"], parses["seconds"] - before["seconds"]
            print(f"{which}: {seconds:.1f} s, of which {count} GGUF header parses took {parsing:.1f} s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
