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
from collections.abc import Callable
from functools import cache

import torch

from marspec.errors import MarspecError

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
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return
    release_range(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def release_range(start: int, nbytes: int) -> None:
    """:func:`release_pages` for the ``nbytes`` of memory at address ``start`` (a numpy array's, say)."""
    madvise = _madvise()
    if madvise is None:
        return
    end = start + nbytes
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # only pages wholly inside the tensor
    if last > first:
        madvise(first, last - first, _MADV_PAGEOUT)  # an old kernel refuses (EINVAL): nothing lost


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    if sys.platform != "linux":
        return None
    try:
        func = ctypes.CDLL(None).malloc_trim  # glibc's; musl and others have none
    except AttributeError:
        return None
    func.argtypes = (ctypes.c_size_t,)
    func.restype = ctypes.c_int
    return func


def trim_heap() -> None:
    """Give the C heap's free memory back to the kernel (glibc; a no-op elsewhere). Rewriting a layer
    frees temporaries of a few to tens of MB, which glibc keeps in its heap rather than unmapping: over
    the 1.5B target's 197 int8 layers that kept ~1 GB resident for nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def own_remaining_tensors(model: torch.nn.Module) -> None:
    """Copy every parameter and buffer of ``model`` into memory of its own, so that no tensor still views
    the checkpoint file and its mapping can go (with it, the pages of the weights already rewritten).
    The copy is made a slice at a time, each slice's pages handed back once copied, so a large tensor
    (the 1.5B's 0.9 GB embedding) is never resident twice."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = _copy_releasing(tensor.data)


def _copy_releasing(original: torch.Tensor, slice_bytes: int = 64 << 20) -> torch.Tensor:
    if not original.is_contiguous() or original.dim() == 0:
        return original.clone()
    copy = torch.empty_like(original)
    source, target = original.view(-1), copy.view(-1)
    step = max(1, slice_bytes // original.element_size())
    for start in range(0, source.numel(), step):
        target[start : start + step] = source[start : start + step]
        release_pages(source[start : start + step])
    return copy


def rewrite_linears(
    model: torch.nn.Module,
    rewrite: Callable[[torch.nn.Linear], torch.nn.Module],
    refusal: str,
    trim: bool = False,
) -> int:
    """Replace every ``nn.Linear`` of ``model`` with ``rewrite(linear)``, in place, handing each old
    weight's pages back once it is rewritten (and the C heap's free memory too when ``trim``); return
    how many were replaced. A layer whose weights are neither fp32 nor bf16 is refused with ``refusal``
    formatted with its ``name`` and ``dtype``. Layers of other types (already rewritten) are left alone.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            if child.weight.dtype not in (torch.float32, torch.bfloat16):
                raise MarspecError(refusal.format(name=name, dtype=child.weight.dtype))
            setattr(parent, name, rewrite(child))
            release_pages(child.weight)
            if trim:
                trim_heap()
            replaced += 1
    return replaced
