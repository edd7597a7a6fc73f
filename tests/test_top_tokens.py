"""The vocabulary kernels (``marspec_vocab::argmax`` and ``::top2``, kernels/vocab.cpp) answer exactly as
torch's operators do (``torch.argmax``; the verifiers' top-2: the argmax, then the argmax with it masked),
ties, -inf, +inf and NaN included, for any row width and leading shape; ``verify.top_tokens`` takes them
only once the kernels' library is loaded and otherwise runs torch's operators."""

from __future__ import annotations

import math

import pytest
import torch

from marspec.backends import kernels
from marspec.backends.kernels import kernels_available
from marspec.verify import top_tokens

needs_kernel = pytest.mark.skipif(
    not kernels_available(),
    reason="no marspec kernels here (needs x86-64 Linux, AVX-512 VNNI, a compiler)",
)

INF, NAN = math.inf, math.nan


def torch_top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition the verifiers had before the kernel, written out: argmax, then masked argmax."""
    first = logits.argmax(dim=-1, keepdim=True)
    second = logits.scatter(-1, first, -INF).argmax(dim=-1, keepdim=True)
    tokens = torch.cat([first, second], dim=-1)
    return logits.gather(-1, tokens), tokens


def assert_same_as_torch(logits: torch.Tensor) -> None:
    values, tokens = kernels.ops().vocab_top2(logits)
    want_values, want_tokens = torch_top2(logits)
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    # NaN == NaN for the comparison; the values are the logits themselves, bit for bit
    assert torch.equal(values.nan_to_num(1234.5), want_values.nan_to_num(1234.5))
    assert torch.equal(kernels.ops().vocab_argmax(logits), logits.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 33, 1000, 151936])
@pytest.mark.parametrize("shape", [(), (3,), (2, 5)])
def test_random_rows_of_any_width_and_shape(width: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(width)
    assert_same_as_torch(torch.randn(*shape, width) * 5)


@needs_kernel
@pytest.mark.parametrize(
    "row",
    [
        [1.0, 3.0, 3.0, 2.0, 3.0],  # the first maximum, then the next equal one
        [3.0, 1.0, 2.0, 2.0, 0.0],  # a tie for second: the first of them
        [5.0] * 40,  # every value equal
        [0.0, -0.0, 0.0],  # signed zeros are equal
        [-2.0, -1.0, -3.0],
        [1.0, INF, 2.0, INF],  # +inf, twice
        [3.0, -INF, -INF],  # nothing but -inf beside the winner: torch's masked copy ties with it
        [-INF, 3.0, -INF],
        [-INF] * 20,  # all -inf
        [1.0, NAN, 5.0, NAN],  # torch's argmax takes a NaN as the maximum
        [NAN] * 3,
    ],
)
def test_ties_and_special_values_as_torch(row: list[float]) -> None:
    assert_same_as_torch(torch.tensor(row))


@needs_kernel
def test_ties_across_lanes_keep_the_first_index() -> None:
    # equal maxima 16 apart land in the same lane, 1 apart in neighbouring lanes
    for positions in ([5, 21], [21, 5 + 32], [7, 8], [100, 3, 64], [0, 151935]):
        row = torch.zeros(151936)
        row[positions] = 9.0
        row[17] = 8.0
        assert_same_as_torch(row)
        assert_same_as_torch(torch.stack([row, row.flip(0)]))


@needs_kernel
def test_non_contiguous_rows() -> None:
    logits = torch.randn(300, 4).t()  # [4, 300], strided
    assert_same_as_torch(logits)


def test_torch_runs_where_the_kernel_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 50)
    monkeypatch.setattr(top_tokens, "_library_loaded", lambda: False)
    assert not top_tokens.kernel_takes(logits)
    assert torch.equal(top_tokens.argmax(logits), logits.argmax(-1))
    values, tokens = top_tokens.top2(logits)
    want_values, want_tokens = torch_top2(logits)
    assert torch.equal(tokens, want_tokens) and torch.equal(values, want_values)
    assert not top_tokens.kernel_takes(logits.double())
    assert not top_tokens.kernel_takes(torch.empty(0, 5))


@needs_kernel
def test_the_kernel_is_taken_once_the_library_is_loaded() -> None:
    assert top_tokens.kernel_takes(torch.randn(2, 8))
    assert not top_tokens.kernel_takes(torch.randn(2, 8).to(torch.bfloat16))
