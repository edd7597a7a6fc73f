"""What transformers' reading of a GGUF's configuration leaves out, put back from the file.

transformers maps a GGUF's metadata to a configuration key by key; two things a model's forward depends on
are not among its keys for the families marspec runs, and a model built without them runs, silently
wrong:

- the head width (``{arch}.attention.key_length``) of a Qwen3 (or Llama) whose heads are not
  ``hidden / heads`` wide: transformers keeps the configuration class's default (128 for Qwen3);
- Llama 3.x's rope scaling, which llama.cpp writes as a tensor of per-frequency divisors
  (``rope_freqs.weight``), not as metadata: the configuration gets the scaling whose divisors these are
  (:data:`~marspec.models.shapes.LLAMA3_SCALING`'s, at the file's largest divisor), and a file whose
  divisors are no such scaling is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from marspec.errors import MarspecError
from marspec.models.gguf_parse import gguf_reader

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ROPE_FREQS = "rope_freqs.weight"


def complete_config(config: PretrainedConfig, gguf_path: Path) -> None:
    """Set on ``config`` (read from ``gguf_path`` by transformers) the head width and rope scaling the
    file states and transformers did not read (see the module); raise a one-line error for rope
    divisors marspec cannot state as a scaling."""
    reader = gguf_reader(gguf_path)
    arch = _field(reader, "general.architecture")
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim") and config.head_dim != int(key_length):
        config.head_dim = int(key_length)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        config.rope_parameters = llama3_rope_parameters(
            np.asarray(freqs.data, dtype=np.float32), config, gguf_path
        )


def llama3_rope_parameters(divisors: np.ndarray, config: PretrainedConfig, gguf_path: Path) -> dict[str, Any]:
    """transformers' rope parameters for Llama 3's scaling whose ``rope_freqs`` are ``divisors``."""
    from marspec.models.shapes import LLAMA3_SCALING, llama3_rope_factors

    theta = float(config.rope_parameters["rope_theta"])
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    scaling = {**LLAMA3_SCALING, "factor": float(divisors.max())}
    expected = llama3_rope_factors(theta, head_dim, scaling)
    if config.model_type != "llama" or not np.allclose(divisors, expected, rtol=1e-5, atol=0.0):
        raise MarspecError(
            f"{gguf_path} scales its rope by per-frequency divisors ({ROPE_FREQS}) that are not Llama 3's "
            "rope scaling; marspec runs only that one: use a GGUF converted from a Llama 3.x checkpoint"
        )
    return {"rope_type": "llama3", "rope_theta": theta, **scaling}


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents() if key in reader.fields else None
