"""vLLM's V1 verifier outside an engine, as its CPU worker would call it (for tests and benchmarks).

Imports vLLM inside its functions only, like :mod:`.plugin`.
"""

from __future__ import annotations

from typing import Any

import torch


def install_cpu_overrides() -> None:
    """vLLM's CPU stand-ins for its Triton kernels, installed the way its CPU worker installs them:
    v0.32 registers them from its platform, v0.28 assigns them when its CPU model runner starts.
    Running this again puts vLLM's own stand-ins back over anything installed since."""
    from vllm.platforms.cpu import CpuPlatform

    if hasattr(CpuPlatform, "register_triton_kernel_overrides"):
        CpuPlatform.register_triton_kernel_overrides()
    else:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._postprocess_triton(None)  # it reads no runner state


def sampling_metadata(temperature: torch.Tensor) -> Any:
    """vLLM's ``SamplingMetadata`` for a batch with these per-request temperatures (0: greedy) and no
    other sampling parameter (no top-k/top-p, penalties, logprobs or seeds)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = temperature == 0
    batch = temperature.shape[0]
    return SamplingMetadata(
        temperature=temperature.float(),
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
