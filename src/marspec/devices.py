"""Where the models, the token buffer, the caches and verification live: ``cpu``, ``cuda``, ``mps`` or
``auto`` (the first of cuda, mps and cpu this torch build can use).

Only ``cpu`` has been run by this project (its machines have no GPU); the loop keeps every tensor on
the target's device, so the CPU tests exercise the code path any device takes.
"""

from __future__ import annotations

import torch

from marspec.errors import MarspecError

DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(spec: str | torch.device) -> torch.device:
    """The torch device for ``spec`` ("auto", "cpu", "cuda", "cuda:N" or "mps"), or a MarspecError
    naming what is missing and what to use instead."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise MarspecError(f"device must be one of {', '.join(DEVICES)}, got {spec!r}", field="device")
    name = spec.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind, _, index = name.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise MarspecError(
            f"unknown device {spec!r}: use {', '.join(DEVICES)} (or cuda:N for one of several GPUs)",
            field="device",
        )
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise MarspecError(
                f"device {spec!r}: this torch build sees no CUDA GPU (torch.cuda.is_available() is False): "
                "use --device cpu, or auto to take a GPU when there is one",
                field="device",
            )
        if index and int(index) >= torch.cuda.device_count():
            raise MarspecError(
                f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) are visible",
                field="device",
            )
    if kind == "mps" and not _mps_available():
        raise MarspecError(
            f"device {spec!r}: Apple's MPS backend is not available here: use --device cpu or auto",
            field="device",
        )
    return torch.device(name)


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has done the work queued on it (nothing to wait for on the CPU, whose torch
    calls return when their work is done). For timing a device's work with a wall clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type != "cpu":
        torch.accelerator.synchronize(device)
