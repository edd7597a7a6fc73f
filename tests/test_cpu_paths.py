"""The CPU kernel paths (:mod:`marspec.backends.kernels`): every path this machine runs gives the same bits
as the others for the same inputs (the operators themselves, loaded side by side), the standalone harness
gives the same hashes on every path it can build (ARM NEON under qemu-user where the cross-compiler and
qemu are installed; ``make test`` installs them and requires it), MARSPEC_CPU_PATH forces a path and
refuses one it cannot run in one line, and the operators refuse bad arguments before reading them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_dequantize import HALVES, Q
from test_gguf_dequantize import random_blocks as dequantize_blocks
from test_q6k import random_blocks  # valid random Q6_K bytes

from marspec.backends import kernels
from marspec.backends.kernels import library, paths
from marspec.backends.q4k import BLOCK_BYTES as Q4K_BLOCK_BYTES
from marspec.backends.q4k import Q4KLinear, dequantize_q4k
from marspec.backends.q6k import Q6K_BLOCK_BYTES, Q6KLinear, dequantize_q6k
from marspec.errors import MarspecError

needs_kernels = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}"
)
RUNNABLE = [path for path in kernels.runnable_paths() if not path.amx]  # amx rides on avx512_vnni's library
KERNELS_DIR = Path(library.__file__).parent


def path_ops(name: str):
    return kernels.library_ops(kernels.path_named(name))


@pytest.fixture(scope="module")
def layers() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "q4k": Q4KLinear.from_float(torch.randn(70, 1024) * 0.05, torch.randn(70)),
        "q4k_896": Q4KLinear.from_float(torch.randn(40, 896) * 0.05),
        "q6k": Q6KLinear.from_gguf_blocks(random_blocks(48, 768), torch.randn(48)),
    }


def linear_on(path: str, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    ops = path_ops(path)
    op = ops.q4k_linear if isinstance(layer, Q4KLinear) else ops.q6k_linear
    return op(x, layer.blocks, layer.out_features, layer.bias)


@needs_kernels
@pytest.mark.parametrize("path", [p.name for p in RUNNABLE])
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 17])
def test_every_path_gives_the_linear_kernels_bits(
    layers: dict[str, torch.nn.Module], path: str, rows: int
) -> None:
    torch.manual_seed(rows)
    for name, layer in layers.items():
        x = torch.randn(rows, layer.in_features)
        x[0] *= 200.0
        reference = layer(x)  # this process's path
        assert torch.equal(linear_on(path, layer, x), reference), f"{name}, {rows} rows on {path}"


def extreme_blocks(rows: int, cols: int, block_bytes: int, d_bytes: slice, scale_bytes: slice, scale: int):
    """GGUF blocks whose every code is the format's largest (all code bits set), its scales ``scale``
    (a byte) and its d (and dmin) 1/1024."""
    blocks = np.full((rows, cols // 256, block_bytes), 0xFF, dtype=np.uint8)
    blocks[..., scale_bytes] = scale
    blocks[..., d_bytes] = (
        np.full((rows, cols // 256, 1), 1 / 1024, dtype=np.float16)
        .view(np.uint8)
        .repeat((d_bytes.stop - d_bytes.start) // 2, axis=-1)
    )
    return blocks.reshape(rows, -1)


@needs_kernels
@pytest.mark.parametrize("path", [p.name for p in RUNNABLE])
def test_the_largest_codes_against_the_largest_activations_sum_exactly_on_every_path(path: str) -> None:
    """Where a path adds products in int16 before widening them (AVX2's pair sums), the worst case fits:
    every code at its largest against activation rows at +-127 in every position, whose products add up
    with one sign, give the float64 reference's outputs (an int16 overflow would be off by 65536 units)."""
    q6k_raw = extreme_blocks(32, 512, Q6K_BLOCK_BYTES, slice(208, 210), slice(192, 208), 0x81)  # sc -127
    q4k_raw = extreme_blocks(32, 512, Q4K_BLOCK_BYTES, slice(0, 4), slice(4, 16), 0xFF)  # sc, m 63
    x = torch.ones(3, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0  # +-1: quantised to +-127 exactly
    for name, layer, weight in (
        ("q6k", Q6KLinear.from_gguf_blocks(q6k_raw), dequantize_q6k(q6k_raw)),
        ("q4k", Q4KLinear.from_gguf_blocks(q4k_raw), dequantize_q4k(q4k_raw)),
    ):
        expected = x.double() @ weight.double().T
        torch.testing.assert_close(linear_on(path, layer, x).double(), expected, rtol=1e-5, atol=1e-3), name


@needs_kernels
@pytest.mark.parametrize("path", [p.name for p in RUNNABLE])
def test_every_path_gives_the_attention_and_vocabulary_kernels_bits(path: str) -> None:
    torch.manual_seed(1)
    ops, mine = path_ops(path), kernels.ops()
    for d in (16, 64, 128):
        query, keys, values = torch.randn(4, 7, d), torch.randn(2, 40, d), torch.randn(2, 40, d)
        visible = torch.tensor([1, 5, 16, 17, 30, 33, 40])
        args = (query, keys, values, visible, d**-0.5)
        assert torch.equal(ops.attention_rows(*args), mine.attention_rows(*args)), f"head size {d} on {path}"
    logits = torch.randn(5, 151_936)
    logits[1, 77] = logits[1, 5000] = 99.0  # a tie
    assert all(
        torch.equal(a, b) for a, b in zip(ops.vocab_top2(logits), mine.vocab_top2(logits), strict=True)
    )
    assert torch.equal(ops.vocab_argmax(logits), mine.vocab_argmax(logits))


@needs_kernels
def test_a_row_holding_a_nan_gives_nan_in_its_outputs_only(layers: dict[str, torch.nn.Module]) -> None:
    for name, layer in layers.items():
        x = torch.randn(4, layer.in_features)
        x[2, 5] = float("nan")
        x[3, 0] = float("inf")
        y = layer(x)
        assert y[2:].isnan().all(), name
        assert y[:2].isfinite().all(), name


def test_an_unknown_or_unrunnable_path_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.PATH_VARIABLE, "sse9")
    with pytest.raises(MarspecError) as unknown:
        paths.chosen_path()
    assert "'sse9' is not a kernel path" in str(unknown.value) and "avx2" in str(unknown.value)
    assert "this CPU runs:" in str(unknown.value) and "\n" not in str(unknown.value)
    other = "neon" if paths.machine() == "x86_64" else "avx2"
    monkeypatch.setenv(paths.PATH_VARIABLE, other)
    with pytest.raises(MarspecError) as unrunnable:
        paths.chosen_path()
    assert f"{other!r} needs" in str(unrunnable.value) and "this CPU runs" in str(unrunnable.value)


@pytest.mark.parametrize("path", [p.name for p in RUNNABLE])
def test_the_variable_forces_any_path_this_cpu_runs(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setenv(paths.PATH_VARIABLE, path)
    assert paths.chosen_path() == kernels.path_named(path)


def test_a_cpu_without_any_path_gets_none_and_the_reason_names_what_is_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(paths.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(paths, "cpu_features", lambda: frozenset({"sse2"}))
    assert paths.chosen_path() is None
    assert not any(paths.runs(p, frozenset({"sse2"})) for p in paths.PATHS)


def test_a_forced_path_runs_the_engine_in_a_process_of_its_own() -> None:
    # The process's path is decided once: a fresh process with the variable set runs the forced path.
    script = "from marspec.backends import kernels; print(kernels.describe())"
    env = {**os.environ, paths.PATH_VARIABLE: "avx2"}
    if not any(p.name == "avx2" for p in RUNNABLE):
        pytest.skip("this CPU does not run the AVX2 path")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"CPU kernels: avx2 (AVX2, forced by {paths.PATH_VARIABLE})"


@needs_kernels
@pytest.mark.parametrize("path", [p.name for p in RUNNABLE])
def test_every_path_dequantizes_gguf_blocks_alike(path: str) -> None:
    ops, mine = path_ops(path), kernels.ops()
    for qtype in HALVES:
        blocks = torch.from_numpy(dequantize_blocks(qtype, (9, 2), seed=int(qtype)))
        assert torch.equal(ops.gguf_dequantize(blocks, int(qtype)), mine.gguf_dequantize(blocks, int(qtype)))


@needs_kernels
@pytest.mark.parametrize("path", [p.name for p in RUNNABLE])
def test_every_path_packs_gguf_blocks_alike(path: str) -> None:
    ops, mine = path_ops(path), kernels.ops()
    for qtype in (Q.Q4_K, Q.Q6_K):
        blocks = torch.from_numpy(dequantize_blocks(qtype, (35, 2), seed=int(qtype)))
        assert torch.equal(ops.gguf_pack_tiles(blocks, int(qtype)), mine.gguf_pack_tiles(blocks, int(qtype)))


@needs_kernels
def test_the_operators_refuse_bad_arguments_before_reading_them() -> None:
    ops = kernels.ops()
    visible = torch.tensor([1])
    with pytest.raises(RuntimeError, match="head size 0"):
        ops.attention_rows(torch.randn(2, 1, 0), torch.randn(1, 4, 0), torch.randn(1, 4, 0), visible, 1.0)
    with pytest.raises(RuntimeError, match="must be on the CPU"):
        ops.attention_rows(
            torch.randn(2, 1, 16, device="meta"), torch.randn(1, 4, 16), torch.randn(1, 4, 16), visible, 1.0
        )
    q, k, v = torch.randn(2, 3, 16), torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    caches = [torch.zeros(1, 1, 8, 16), torch.zeros(1, 1, 8, 16)]
    for starts in ([0, 100, 3], [0, 2, 1, 3][:3], [0, -1, 3]):
        with pytest.raises(RuntimeError, match="starts"):
            ops.attention_segments(
                q,
                k,
                v,
                caches,
                [c.clone() for c in caches],
                torch.tensor(starts),
                torch.tensor([1, 1, 1]),
                1.0,
            )
    with pytest.raises(RuntimeError, match="must be on the CPU"):
        ops.q4k_linear(torch.randn(1, 256, device="meta"), torch.zeros(1, 4864, dtype=torch.uint8), 32, None)


@needs_kernels
def test_the_segments_schema_says_it_writes_the_caches() -> None:
    schema = kernels.ops().attention_segments.default._schema
    written = {arg.name for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write}
    assert written == {"caches_k", "caches_v"}


def build_harness(tmp_path: Path, name: str, compiler: str, flags: tuple[str, ...]) -> Path:
    binary = tmp_path / f"harness-{name}"
    command = [
        compiler,
        "-std=c++17",
        "-O2",
        "-ffp-contract=off",
        *flags,
        str(KERNELS_DIR / "harness.cpp"),
        "-o",
        str(binary),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return binary


def harness_hashes(command: list[str]) -> list[str]:
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr  # a row that differs alone, or a NaN row with numbers
    return [line for line in out.stdout.splitlines() if not line.startswith("path ")]


def isa_flags(path: paths.CpuPath) -> tuple[str, ...]:
    return (*path.flags, f"-D{path.isa_macro}")


@pytest.mark.skipif(paths.machine() != "x86_64", reason="the x86 paths' harnesses")
def test_the_harness_gives_every_x86_path_the_same_hashes(tmp_path: Path) -> None:
    # AVX-VNNI is built on every machine (its source is checked) and run where the CPU has it.
    hashes = {}
    for path in paths.PATHS:
        if path.machine != "x86_64" or path.amx:
            continue
        binary = build_harness(tmp_path, path.name, "c++", isa_flags(path))
        if paths.runs(path):
            hashes[path.name] = harness_hashes([str(binary)])
    assert "avx2" in hashes and len(set(map(tuple, hashes.values()))) == 1, hashes


def test_the_neon_path_gives_the_same_hashes_under_qemu(tmp_path: Path) -> None:
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if paths.machine() == "aarch64":
        cross, qemu = shutil.which("c++"), None
    if cross is None or (paths.machine() != "aarch64" and qemu is None):
        if os.environ.get("MARSPEC_REQUIRE_QEMU"):
            pytest.fail("aarch64-linux-gnu-g++ and qemu-aarch64 are required (make test installs them)")
        pytest.skip("no aarch64 cross-compiler and qemu-user here")
    neon = kernels.path_named("neon")
    binary = build_harness(tmp_path, "neon", cross, (*isa_flags(neon), "-static"))
    neon_hashes = harness_hashes([qemu, str(binary)] if qemu else [str(binary)])
    reference = build_harness(tmp_path, "avx2", "c++", isa_flags(kernels.path_named("avx2")))
    assert neon_hashes == harness_hashes([str(reference)])


def test_a_build_cleans_what_a_killed_build_left_and_an_unwritable_cache_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from marspec.backends.kernels.build import BuildError, load_library

    source = tmp_path / "ok.cpp"
    source.write_text("int marspec_answer() { return 42; }\n")
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "cache"))
    left = tmp_path / "cache" / "kernels" / ".marspec_ok-killed"
    left.mkdir(parents=True)
    load_library("marspec_ok", (source,), ("-O0",))
    assert not left.exists() and list((tmp_path / "cache" / "kernels").glob("marspec_ok-*.so"))
    not_a_folder = tmp_path / "a-file"  # (a read-only folder would not stop root, which CI runs as)
    not_a_folder.write_text("")
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(not_a_folder / "cache"))
    with pytest.raises(BuildError, match="set MARSPEC_CACHE_DIR to a writable folder"):
        load_library("marspec_ok", (source,), ("-O0",))


@needs_kernels
@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils) to read a library's symbols")
@pytest.mark.parametrize("path", [p.name for p in RUNNABLE])
def test_a_paths_library_exports_none_of_its_kernels(path: str) -> None:
    # Exported, a second path's library loaded in the same process would have its calls bound to the
    # first's functions (another instruction set's code), and every comparison above would be void.
    from marspec.backends.kernels.build import library_path

    chosen = kernels.path_named(path)
    path_ops(path)  # built and loaded
    so = library_path(f"marspec_kernels_{chosen.library}", library.SOURCES, library.build_flags(chosen))
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", "-C", str(so)], capture_output=True, text=True, check=True
    )
    leaked = [
        line
        for line in symbols.stdout.splitlines()
        if "marspec_kernels::" in line or "marspec_simd::" in line
    ]
    assert not leaked, leaked[:5]
