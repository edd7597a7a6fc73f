"""Giving memory back while a loaded model is rewritten into another layout (prepacked or int8).

transformers loads a safetensors checkpoint as views of the file mapped into memory. Prepacking or
quantising a layer reads its weight (its file pages become resident) and writes a copy in the new
layout; the old pages stay resident until the whole mapping is gone, so rewriting a model held both
copies at once: the default pair peaked at ~14 GB for ~7 GB of weights. Asking the kernel to reclaim
each weight's pages once it is copied keeps the peak near one copy of the model.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from functools import cache

import torch

# madvise(2) advice: reclaim these pages now. Content-preserving: a page that is touched again is read
# back from its file (or from swap), so advising memory that is still in use costs time, never data.
_MADV_PAGEOUT = 21


@cache
def _madvise() -> ctypes._CFuncPtr | None:
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    func = libc.madvise
    func.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    func.restype = ctypes.c_int
    return func


def release_pages(tensor: torch.Tensor) -> None:
    """Ask the kernel to reclaim the whole memory pages under ``tensor`` (a hint; best effort, Linux
    only). For a weight that has just been copied into another layout."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # only pages wholly inside the tensor
    if last > first:
        madvise(first, last - first, _MADV_PAGEOUT)  # an old kernel refuses (EINVAL): nothing lost


def own_remaining_tensors(model: torch.nn.Module) -> None:
    """Copy every parameter and buffer of ``model`` into memory of its own, so that no tensor still views
    the checkpoint file and its mapping can go (with it, the pages of the weights already rewritten)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
