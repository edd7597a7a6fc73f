"""The row attention kernel (``marspec_attention::rows``, kernels/attention.cpp): each row against its own
prefix computes softmax attention (float64 reference), the same bits whatever rows share the call, and
row-by-row attention takes it for chains and token trees alike; ``segments`` attends the rows of several
sequences, each against its own cache, as ``rows`` would. Caches of float32 or fp16: fp16 keys and values
give the bits of their float32 widenings, and ``segments`` rounds what it writes as torch rounds."""

from __future__ import annotations

import pytest
import torch

from marspec.backends import kernels, row_attention
from marspec.backends.kernels import kernels_available
from marspec.backends.row_attention import row_by_row_attention

needs_kernel = pytest.mark.skipif(
    not kernels_available(),
    reason="no marspec kernels here (needs x86-64 Linux, AVX-512 VNNI, a compiler)",
)


def reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: list[int], scale: float
):
    """float64 attention of query [H, Q, D] rows over their first visible[i] positions: [Q, H, D]."""
    group = query.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, dim=0)  # [H, L, D]
    v = values.double().repeat_interleave(group, dim=0)
    out = []
    for i, seen in enumerate(visible):
        weights = torch.softmax(
            (query[:, i].double()[:, None] * k[:, :seen]).sum(-1) * scale, dim=-1
        )  # [H, seen]
        out.append((weights[..., None] * v[:, :seen]).sum(1))  # [H, D]
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("cache", [torch.float32, torch.float16], ids=["float32", "fp16"])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(12, 2, 128), (14, 2, 64), (4, 4, 16)])
def test_each_row_attends_its_prefix(heads: int, kv_heads: int, d: int, cache: torch.dtype) -> None:
    torch.manual_seed(0)
    length = 70
    # Keys and values as a cache holds them: views of a longer buffer, so position strides are not D.
    buffer = (torch.randn(2, kv_heads, 128, d) * 2).to(cache)
    keys, values = buffer[0, :, :length], buffer[1, :, :length]
    query = torch.randn(heads, 13, d) * 2
    visible = [1, 2, 5, 16, 17, 31, 32, 33, 50, 64, 65, 69, 70]
    out = kernels.ops().attention_rows(query, keys, values, torch.tensor(visible), d**-0.5)
    assert out.shape == (13, heads, d) and out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), reference(query, keys, values, visible, d**-0.5), rtol=1e-5, atol=1e-5
    )
    # A row's bits do not depend on the other rows of its call.
    for i in range(13):
        alone = kernels.ops().attention_rows(
            query[:, i : i + 1].contiguous(), keys, values, torch.tensor(visible[i : i + 1]), d**-0.5
        )
        assert torch.equal(alone[0], out[i]), i
    if cache == torch.float16:  # the bits of the float32 widenings: the rounding is in the cache alone
        widened = buffer.float()
        rows = torch.tensor(visible)
        assert torch.equal(out, kernels.ops().attention_rows(query, widened[0], widened[1], rows, d**-0.5))


@needs_kernel
def test_extreme_scores_stay_finite_and_a_one_position_row_is_its_value() -> None:
    query = torch.full((2, 2, 16), 40.0)
    keys = torch.cat([torch.full((1, 3, 16), 40.0), torch.full((1, 3, 16), -40.0)], dim=1)  # [1, 6, 16]
    values = torch.randn(1, 6, 16)
    out = kernels.ops().attention_rows(query, keys, values, torch.tensor([1, 6]), 1.0)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 0], values[0, 0])
    torch.testing.assert_close(out[1, 0], values[0, :3].mean(0))  # the -40 keys get ~no weight


@needs_kernel
def test_row_by_row_attention_takes_the_kernel_for_chains_and_trees() -> None:
    torch.manual_seed(1)
    query, key, value = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32)
    module = torch.nn.Module()
    assert row_attention.kernel_takes(query)
    chain, _ = row_by_row_attention(module, query, key, value, None)  # rows see 7, 8, 9 positions
    assert chain.shape == (1, 3, 4, 32)
    expected = reference(query[0], key[0], value[0], [7, 8, 9], 32**-0.5)
    torch.testing.assert_close(chain[0].double(), expected, rtol=1e-5, atol=1e-5)
    # A tree's rows: the last sees positions 0-5 and 7 (not 6); gathered, it is the chain row of those keys.
    mask = torch.zeros(1, 1, 3, 9, dtype=torch.bool)
    mask[0, 0, 0, :7] = mask[0, 0, 1, :8] = True
    mask[0, 0, 2, [0, 1, 2, 3, 4, 5, 7]] = True
    tree, _ = row_by_row_attention(module, query, key, value, mask)
    assert torch.equal(tree[0, :2], chain[0, :2])
    seen = [0, 1, 2, 3, 4, 5, 7]
    alone, _ = row_by_row_attention(module, query[:, :, 2:], key[:, :, seen], value[:, :, seen], None)
    assert torch.equal(tree[0, 2], alone[0, 0])


@needs_kernel
@pytest.mark.parametrize("cache", [torch.float32, torch.float16], ids=["float32", "fp16"])
def test_packed_sequences_rows_are_written_to_their_own_caches_and_attended_there(cache: torch.dtype) -> None:
    """``marspec_attention::segments``: rows of several sequences in one call, each row's key and value
    written to its own sequence's cache (buffers longer than their use) at its position, then attended
    there: the same cache contents, and the same bits, as each sequence's own write and rows() call.
    An fp16 cache holds the rows rounded as torch's copy rounds them."""
    torch.manual_seed(2)
    heads, kv_heads, d = 12, 2, 128
    cached, rows = [40, 7, 90], [3, 1, 5]  # each sequence's cached positions and new rows
    # [keys | values][1, H_kv, capacity, D]
    caches = [torch.randn(2, 1, kv_heads, n + 16, d).to(cache) for n in cached]
    expected = [c.clone() for c in caches]
    query = torch.randn(heads, sum(rows), d)
    new = torch.randn(2, kv_heads, sum(rows), d)  # the rows' own keys and values
    # Values that test a rounding to fp16: a tie between two halves, the largest half's edge (65520 and up
    # would be infinite), a subnormal half.
    new[0, 0, 0, :4] = torch.tensor([1 + 2.0**-11, 65519.0, -65519.0, 3 * 2.0**-25])
    visible = [n + i + 1 for n, r in zip(cached, rows, strict=True) for i in range(r)]
    starts = [0, 3, 4, 9]

    def attend(seen: list[int]) -> torch.Tensor:
        caches_k, caches_v = [c[0] for c in caches], [c[1] for c in caches]
        return kernels.ops().attention_segments(
            query, new[0], new[1], caches_k, caches_v, torch.tensor(starts), torch.tensor(seen), d**-0.5
        )

    out = attend(visible)
    assert out.shape == (9, heads, d)
    for s in range(3):
        a, b = starts[s], starts[s + 1]
        end = cached[s] + rows[s]
        expected[s][:, 0, :, cached[s] : end] = new[:, :, a:b]  # rounded by torch's copy where fp16
        assert torch.equal(caches[s], expected[s]), s  # written where its rows are, nothing else touched
        alone = kernels.ops().attention_rows(
            query[:, a:b],
            expected[s][0, 0, :, :end],
            expected[s][1, 0, :, :end],
            torch.tensor(visible[a:b]),
            d**-0.5,
        )
        assert torch.equal(out[a:b], alone), s
    with pytest.raises(RuntimeError, match="sees 107 positions of 106"):
        attend([*visible[:-1], 107])


@pytest.mark.parametrize("cache", [torch.float32, torch.float16], ids=["float32", "fp16"])
def test_heads_the_kernel_does_not_take_are_attended_by_sdpa(cache: torch.dtype) -> None:
    query = torch.randn(1, 2, 2, 8)
    key, value = torch.randn(1, 2, 5, 8).to(cache), torch.randn(1, 2, 5, 8).to(cache)
    assert not row_attention.kernel_takes(query)  # 8 wide
    out, _ = row_by_row_attention(torch.nn.Module(), query, key, value, None)
    assert out.dtype == torch.float32
    expected = reference(query[0], key[0], value[0], [4, 5], 8**-0.5)
    torch.testing.assert_close(out[0].double(), expected, rtol=1e-5, atol=1e-5)
