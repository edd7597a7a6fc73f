"""Loading a converted model and its tokenizer for inference."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.backends.int4 import quantize_int4
from marspec.backends.int8 import use_int8_embedding
from marspec.errors import MarspecError, one_line
from marspec.models.cache import models_root
from marspec.models.convert import (
    ensure_float_weights,
    folder_gguf,
    quiet_transformers,
    release_gguf,
    resolve_model_dir,
)
from marspec.models.hub import names_hub_model
from marspec.models.int4_cache import int4_model_file, read_int4_model, write_int4_model
from marspec.models.registry import MODELS, ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


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
        f"unknown dtype {dtype!r}: use auto (the default), fp32 (exact) or bf16 (half the memory); fp16 "
        "also loads"
    )


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    int4_linears: bool = False,
    int8_linears: bool = False,
    int8_embedding: bool = False,
    keep_gguf: bool = True,
    q4k_form: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelSpec | None]:
    """Load (converting a GGUF, or fetching a Hub id, first if needed) a causal LM and its tokenizer for
    inference; ``name_or_path`` is resolved by :func:`~marspec.models.convert.resolve_model_dir`.

    ``int4_linears``: the linear layers come back in 4 bits
    (:func:`~marspec.backends.int4.quantize_int4`). A known model's folder holding its GGUF builds them
    straight from it (:mod:`marspec.models.gguf_int4`: the same model, without writing or holding its
    float32 weights); any other quantises its float weights. A folder in marspec's cache stores the 4-bit
    model it built and later loads read it back (:mod:`marspec.models.int4_cache`). With
    ``int8_embedding`` its token embedding comes back in int8 too
    (:func:`~marspec.backends.int8.use_int8_embedding`: a draft's form, stored apart from the other).

    ``int8_linears``: a folder in marspec's cache comes back as its int8 model
    (:mod:`marspec.models.int8_store`: written once from its GGUF or float32 weights, without a float32
    copy, then read back; its token embedding in int8 too, its attention row by row). Any other folder
    loads in ``dtype``, for the caller to quantise (:func:`~marspec.backends.quantize.quantize_target`).
    ``q4k_form``: the same, in the store's "q4k" form (a GGUF's Q4_K weights kept for the Q4_K kernel) or
    "q4k-draft" form (every layer on it).

    ``keep_gguf=False``: once the int8 or 4-bit form loaded is stored, a known model's folder releases its
    GGUF (:func:`~marspec.models.convert.release_gguf`), so the cache holds what later loads of this form
    read and no more (the default pair: 2.3 GB, not 3.9); another form assembles it again from the
    installed packages. The library's loads do this (:func:`marspec.api.load_lm`).

    ``tokenizer``: one already loaded to use instead of the folder's (a draft's, checked to be its
    target's: a Qwen2.5 tokenizer holds ~0.1 GB).

    Returns ``(model, tokenizer, spec)``; the model is in eval mode with gradients off, and ``spec`` is the
    :class:`ModelSpec` for known names, otherwise None.
    """
    torch_dtype = parse_dtype(dtype)
    folder = resolve_model_dir(name_or_path)
    name = os.fspath(name_or_path)
    spec = MODELS.get(name)
    cached = folder.resolve().parent == models_root().resolve()
    fix = _repair_hint(folder, name_or_path, cached)
    model = stored = None
    if cached and (int8_linears or q4k_form):
        from marspec.models.int8_store import load_int8_model

        with quiet_transformers():
            model = stored = load_int8_model(folder, q4k_form or "int8")
    if cached and int4_linears:
        with quiet_transformers():
            model = stored = read_int4_model(folder, torch_dtype, int8_embedding)
    gguf = folder_gguf(folder) if cached and int4_linears and stored is None else None
    if stored is None and gguf is None and cached:
        ensure_float_weights(folder)
    model, tokenizer, info = _read(folder, model, gguf, torch_dtype, tokenizer, fix)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise MarspecError(f"model folder {folder} lacks {len(missing)} weights ({shown}); {fix}")
    if int4_linears and stored is None:
        _store_int4(model, folder if cached else None, torch_dtype, int8_embedding)
    if cached and not keep_gguf:
        form_stored = (
            int8_linears
            or q4k_form is not None
            or (int4_linears and int4_model_file(folder, torch_dtype, int8_embedding).is_file())
        )
        if form_stored:
            release_gguf(folder)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer, spec


def _read(
    folder: Path,
    model: PreTrainedModel | None,
    gguf: Path | None,
    dtype: torch.dtype,
    tokenizer: PreTrainedTokenizerBase | None,
    fix: str,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, list[str]]]:
    """The tokenizer (unless given) and the model (unless already read from a store): from the GGUF when
    given, else the folder's weights; with transformers' loading info. Errors become one line + ``fix``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info: dict[str, list[str]] = {}
    try:
        with quiet_transformers():
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            if gguf is not None:
                from marspec.models.gguf_int4 import load_gguf_int4

                # Gone if another process wrote the float32 weights in its place: they load below.
                with contextlib.suppress(FileNotFoundError):
                    model = load_gguf_int4(gguf, folder, dtype)
            if model is None:
                model, info = AutoModelForCausalLM.from_pretrained(
                    folder, dtype=dtype, local_files_only=True, output_loading_info=True
                )
    except (MemoryError, MarspecError):
        raise
    except Exception as exc:
        raise MarspecError(f"cannot load the model in {folder} ({one_line(exc)}); {fix}") from exc
    return model, tokenizer, info


def _repair_hint(folder: Path, name_or_path: str | os.PathLike[str], cached: bool) -> str:
    """What a user does about a folder that does not load: the end of the error line."""
    if cached:
        return f"delete {folder} and it will be converted again"
    if names_hub_model(name_or_path):
        name = os.fspath(name_or_path)
        return f"delete {folder} and load {name} again with network access to download it again"
    return f"check that {folder} is a complete Hugging Face causal-LM folder"


def _store_int4(
    model: PreTrainedModel, folder: Path | None, dtype: torch.dtype, int8_embedding: bool
) -> None:
    """``model`` in its 4-bit form (with an int8 embedding when asked), stored in ``folder`` when given."""
    quantize_int4(model)  # nothing to do if built from the GGUF
    if int8_embedding:
        use_int8_embedding(model)
    if folder is not None:
        write_int4_model(model, folder, dtype)


def is_instruct(spec: ModelSpec | None, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether plain-string prompts should go through the chat template.

    A known model decides by its spec; any other model is treated as instruct when its tokenizer has a
    chat template.
    """
    if spec is not None:
        return spec.instruct
    return bool(getattr(tokenizer, "chat_template", None))
