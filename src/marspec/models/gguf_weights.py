"""A GGUF's weights written to one float32 safetensors file a tensor at a time, so that converting a
model never holds more than one dequantized tensor in memory.

transformers' GGUF loader dequantizes the whole model into a state dict and then builds the model from
it; converting that way peaked at ~14 GB resident for the 1.5B target (6.2 GB of fp32 weights). Here each
tensor goes through transformers' own name mapping and per-architecture processing (the same functions
its loader calls, so the weights are the same bytes) and is written straight to disk. The safetensors
library has no streaming writer; its format is one JSON header (names, dtypes, shapes, byte offsets),
then the raw tensors: we reserve room for the header, write the tensors, then write the header, padded
with spaces as the format allows.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from marspec.backends.memory import release_range
from marspec.models.gguf_parse import gguf_reader, one_parse_per_gguf

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# Room reserved per tensor for its header entry (~100 bytes for the longest Qwen2 names).
_HEADER_BYTES_PER_TENSOR = 256


def gguf_tensors(gguf_path: Path, config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face parameter name, float32 array) for every weight of the GGUF, one at a time, exactly
    as transformers' GGUF loader maps and processes them for a model of ``config``."""
    for name, array, _ in gguf_tensors_keeping(gguf_path, config, kept=()):
        yield name, array


def gguf_tensors_keeping(
    gguf_path: Path, config: PretrainedConfig, kept: Collection[Any]
) -> Iterator[tuple[str, np.ndarray, Any]]:
    """:func:`gguf_tensors`, except that a tensor whose GGUF type is in ``kept`` (``GGMLQuantizationType``
    members) comes as its raw blocks (uint8 [rows, bytes a row], the file's bytes) with its type, where
    transformers' processing only reorders its rows or leaves it as it is (:func:`_row_order`: Llama's
    q and k, un-permuted, or any weight of an architecture whose processor changes only norms); everything
    else comes dequantized, with the type None."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    # transformers' read of the configuration and ours of the tensors, and the weights' names (one build
    # of gguf's name map, :mod:`marspec.models.gguf_parse`)
    with one_parse_per_gguf():
        parsed: dict[str, Any] = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
        reader = gguf_reader(gguf_path)
        # The processor of the file's own architecture, as transformers' loader picks it: a Mistral's GGUF
        # is a "llama" whose q and k rows llama.cpp permuted, whatever model type transformers then names.
        architecture = reader_field(reader, "general.architecture")[0]
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
        skeleton = _skeleton(config)
        key_mapping = get_gguf_hf_weights_map(skeleton, processor)
    # A GGUF may carry an output layer the model ties to its input embedding: the model does not load it.
    wanted = {name for name, _ in skeleton.named_parameters()}
    # Processors of mixture-of-experts models put the experts they assemble here instead of returning
    # them; they are handed on as soon as they appear.
    parsed["tensors"] = {}
    for tensor in reader.tensors:
        mapped = key_mapping.get(tensor.name)
        if mapped is not None and mapped not in wanted:
            continue  # e.g. an output layer the model ties to its input embedding: not even dequantized
        order = _row_order(processor, tensor, parsed) if tensor.tensor_type in kept and mapped else None
        if order is not None:
            yield mapped, (tensor.data if order is _SAME else tensor.data[order]), tensor.tensor_type
            release_range(tensor.data.ctypes.data, tensor.data.nbytes)
            continue
        result = processor.process(
            weights=dequantized(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=key_mapping,
            parsed_parameters=parsed,
        )
        # The file's pages of this tensor are read: hand them back, so that reading a whole GGUF never
        # keeps it resident (a 1.1 GB file for the 1.5B target) beside what is built from it.
        release_range(tensor.data.ctypes.data, tensor.data.nbytes)
        if key_mapping.get(result.name) in wanted:
            yield key_mapping[result.name], np.ascontiguousarray(result.weights, dtype=np.float32), None
        while parsed["tensors"]:
            name, weights = parsed["tensors"].popitem()
            if name in wanted:
                yield name, np.ascontiguousarray(weights.numpy(force=True), dtype=np.float32), None


_SAME = np.arange(0)  # a row order that keeps the rows where they are


def _row_order(processor: Any, tensor: Any, parsed: dict[str, Any]) -> np.ndarray | None:
    """The order in which ``processor`` puts ``tensor``'s rows (:data:`_SAME` where it leaves them), or
    None where it does more than reorder rows. Asked of the processor itself, on a column of row
    numbers: raw blocks hold whole rows, so a reordering of rows applies to them as it is."""
    rows = int(tensor.data.shape[0])
    numbers = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    processed = processor.process(
        weights=numbers.copy(), name=tensor.name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
    )
    result = np.asarray(processed.weights)
    if processed.name != tensor.name or result.shape != numbers.shape:
        return None
    if not np.array_equal(np.sort(result[:, 0]), numbers[:, 0]):
        return None
    order = result[:, 0].astype(np.int64)
    return _SAME if np.array_equal(order, numbers[:, 0]) else order


def reader_field(reader: Any, key: str) -> list[Any]:
    """A GGUF field's values as a list (one for a scalar), empty when the file lacks it."""
    if key not in reader.fields:
        return []
    value = reader.fields[key].contents()
    return value if isinstance(value, list) else [value]


def dequantized(data: np.ndarray, qtype: Any, rows_per_chunk: int = 4096) -> np.ndarray:
    """``gguf.dequantize(data, qtype)``, the same values, a chunk of rows at a time into one array.

    gguf dequantizes a tensor in groups of 16 rows but holds every group's result until it joins them,
    so a whole tensor costs twice its float32 size: 1.9 GB for the 1.5B target's 0.9 GB LM head. A
    quantised tensor's rows are whole blocks, so its rows dequantize alone, as they do together.
    """
    from gguf import GGMLQuantizationType, dequantize

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return dequantize(data, qtype)  # a view or one conversion: nothing held twice
    native = native_dequantized(data, qtype)
    if native is not None:
        return native
    if data.ndim < 2 or data.shape[0] <= rows_per_chunk:
        return dequantize(data, qtype)
    first = dequantize(data[:rows_per_chunk], qtype)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:rows_per_chunk] = first
    for start in range(rows_per_chunk, data.shape[0], rows_per_chunk):
        out[start : start + rows_per_chunk] = dequantize(data[start : start + rows_per_chunk], qtype)
    return out


# The formats marspec's kernels dequantize (kernels/dequant_core.h), by ggml type number.
NATIVE_DEQUANTIZED = frozenset({2, 3, 6, 7, 8, 12, 13, 14})  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K


def native_dequantized(data: np.ndarray, qtype: Any) -> np.ndarray | None:
    """``gguf.dequantize(data, qtype)``'s values, bit for bit, from marspec's kernels (7-14x faster than
    gguf's numpy on a 2-core machine), where they take ``qtype`` and run here without a compile (loaded,
    or built already); else None."""
    from marspec.backends.kernels import library_ready, ops, read_only_tensor

    if int(qtype) not in NATIVE_DEQUANTIZED or data.ndim < 1 or data.dtype != np.uint8 or not library_ready():
        return None
    return ops().gguf_dequantize(read_only_tensor(data), int(qtype)).numpy()


def missing_weights(gguf_path: Path, config: PretrainedConfig) -> list[str]:
    """The weights a model of ``config`` loads that no tensor of the GGUF maps to, by name alone (nothing
    is read or dequantized): what converting it would find missing. Models of experts, whose tensors
    transformers' processors assemble, are not checked here (empty)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    with one_parse_per_gguf():  # one build of gguf's name map for the weights' names
        reader = gguf_reader(gguf_path)
        architecture = reader_field(reader, "general.architecture")[0]
        skeleton = _skeleton(config)
        wanted = {name for name, _ in skeleton.named_parameters()}
        if any(".experts." in name for name in wanted):
            return []
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
        key_mapping = get_gguf_hf_weights_map(skeleton, processor)
    found = {key_mapping.get(tensor.name) for tensor in reader.tensors}
    return sorted(wanted - found)


def parameter_names(config: PretrainedConfig) -> set[str]:
    """The weights a model of ``config`` loads (a tied output layer is the input embedding's)."""
    return {name for name, _ in _skeleton(config).named_parameters()}


def _skeleton(config: PretrainedConfig) -> torch.nn.Module:
    """The model on the meta device: its parameter names and shapes, with nothing allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# safetensors' names of the array types written here.
_SAFETENSORS_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int64): "I64",
}


def write_safetensors(
    path: Path,
    tensors: Iterator[tuple[str, np.ndarray]],
    count: int,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write float32 or int8 ``tensors`` (about ``count`` of them, to size the header) to ``path`` one by
    one, with ``metadata`` in the header; return their names. Memory: one tensor at a time."""
    reserved = _aligned(1024 + count * _HEADER_BYTES_PER_TENSOR)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    with open(path, "wb") as f:
        f.seek(8 + reserved)
        for name, array in tensors:
            if name in header:
                raise ValueError(f"tensor {name} appears twice in the GGUF")
            f.write(memoryview(array).cast("B"))
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[array.dtype],
                "shape": list(array.shape),
                "data_offsets": [offset, offset + array.nbytes],
            }
            offset += array.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        if len(encoded) <= reserved:
            f.seek(0)
            f.write(struct.pack("<Q", reserved) + encoded.ljust(reserved, b" "))
            return [name for name in header if name != "__metadata__"]
    # Longer names than any model we know: move the tensors behind a header of the right size.
    _rewrite_with_header(path, encoded, reserved)
    return [name for name in header if name != "__metadata__"]


def _aligned(n: int) -> int:
    """Round up to a multiple of 8, so the tensors start aligned as the safetensors writer aligns them."""
    return (n + 7) // 8 * 8


def _rewrite_with_header(path: Path, encoded: bytes, reserved: int) -> None:
    size = _aligned(len(encoded))
    moved = path.with_suffix(".tmp")
    with open(path, "rb") as src, open(moved, "wb") as dst:
        dst.write(struct.pack("<Q", size) + encoded.ljust(size, b" "))
        src.seek(8 + reserved)
        shutil.copyfileobj(src, dst, 64 << 20)
    moved.replace(path)
