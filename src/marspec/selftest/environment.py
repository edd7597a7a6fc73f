"""What the self-test ran on: versions, the device, and the kernels marspec can use there."""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    pass


def environment(device: torch.device) -> dict[str, str]:
    """Versions, the device, and the kernels marspec can use there (each probe that fails says so)."""
    import transformers

    from marspec import __version__

    env = {
        "python": f"{platform.python_version()} ({platform.platform()})",
        "marspec": __version__,
        "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ""),
        "transformers": transformers.__version__,
        "device": _probe(lambda: _device_name(device)),
        "devices seen": _probe(_devices_seen),
        "torch threads": str(torch.get_num_threads()),
        "attention (SDPA)": _probe(lambda: _sdpa(device)),
    }
    if device.type == "cpu":
        env["CPU kernels"] = _probe(_cpu_kernels)
        env["draft length"] = _probe(_draft_length)
    elif device.type == "cuda":
        env["CUDA kernels"] = _probe(_cuda_kernels)
    return env


def _probe(read: Callable[[], str]) -> str:
    try:
        return read()
    except Exception as exc:  # an introspection call missing from this torch build must not end the run
        return f"unknown ({type(exc).__name__}: {exc})"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory = props.total_memory / 2**30
        return f"{props.name} (compute capability {props.major}.{props.minor}, {memory:.0f} GiB)"
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    from marspec.eval.cpu import cpu_name

    return f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()}"


def _devices_seen() -> str:
    mps = getattr(torch.backends, "mps", None)
    cuda = f"{torch.cuda.device_count()} CUDA" if torch.cuda.is_available() else "no CUDA"
    return f"cpu, {cuda}, {'MPS' if mps is not None and mps.is_available() else 'no MPS'}"


def _sdpa(device: torch.device) -> str:
    if device.type == "cuda":
        cuda = torch.backends.cuda
        flags = {
            "flash": cuda.flash_sdp_enabled() and cuda.is_flash_attention_available(),
            "memory-efficient": cuda.mem_efficient_sdp_enabled(),
            "cuDNN": cuda.cudnn_sdp_enabled(),
            "math": cuda.math_sdp_enabled(),
        }
        return "enabled: " + ", ".join(name for name, on in flags.items() if on)
    if device.type == "cpu":
        fused = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        grouped = "key/value heads grouped under masks (marspec_grouped_sdpa)"
        return f"{'fused flash kernel' if fused else 'math kernel'}; {grouped}"
    return "torch's MPS kernels"


def _cpu_kernels() -> str:
    from marspec.backends import kernels
    from marspec.backends.int4 import int4_available
    from marspec.backends.prepack import prepack_available
    from marspec.backends.quantize import rowwise_int8_available

    engines = torch.backends.quantized.supported_engines
    return ", ".join(
        (
            f"oneDNN {'yes' if torch.backends.mkldnn.is_available() else 'no'}",
            f"prepacked linears {'yes' if prepack_available() else 'no'}",
            f"int8 draft (fbgemm) {'yes' if 'fbgemm' in engines else 'no'}",
            f"int8 target (oneDNN, VNNI/AMX) {'yes' if rowwise_int8_available() else 'no'}",
            f"int4 weights (ATen) {'yes' if int4_available() else 'no'}",
            kernels.describe(),
            f"AMX tiles for many rows {'yes' if kernels.amx_available() else 'no'}",
        )
    )


def _draft_length() -> str:
    """The draft length and stop each pair measured on this CPU drafts with, and the costs behind them."""
    from marspec.draft_length import stored_choices
    from marspec.eval.cpu import cpu_name

    return stored_choices(cpu_name())


def _cuda_kernels() -> str:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return ", ".join(
        (
            f"cuDNN {cudnn or 'no'}",
            f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}",
            f"fp32 matmul precision {torch.get_float32_matmul_precision()} ('highest': no TF32)",
        )
    )
