"""marspec's native CPU kernels: C++ torch operators built on first use for the CPU's instruction set
(:mod:`.paths`: AVX2, AVX-VNNI, AVX-512 VNNI, AMX, ARM NEON; every path the same bits), loaded and
called through :mod:`.library`. Their sources ship in this package."""

from marspec.backends.kernels.library import (
    amx_available,
    amx_from_rows,
    build_id,
    describe,
    kernels_available,
    library_loaded,
    library_ops,
    library_ready,
    ops,
    process_path,
    read_only_tensor,
    unavailable_reason,
)
from marspec.backends.kernels.paths import (
    PATH_VARIABLE,
    PATHS,
    CpuPath,
    chosen_path,
    path_named,
    runnable_paths,
)

__all__ = [
    "PATHS",
    "PATH_VARIABLE",
    "CpuPath",
    "amx_available",
    "amx_from_rows",
    "build_id",
    "chosen_path",
    "describe",
    "kernels_available",
    "library_loaded",
    "library_ops",
    "library_ready",
    "ops",
    "path_named",
    "process_path",
    "read_only_tensor",
    "runnable_paths",
    "unavailable_reason",
]
