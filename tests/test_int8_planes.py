"""Int8 rows on the Q4_K kernel (:class:`marspec.backends.int8_planes.Int8PlanesLinear`): the int8 rows'
own product (their values kept, the sums exact), each row alone, at any width, and back from its tensors."""

from __future__ import annotations

import pytest
import torch

from marspec.backends.int8 import int8_rows
from marspec.backends.int8_planes import Int8PlanesLinear
from marspec.backends.kernels import kernels_available
from marspec.backends.q4k import quantised_rows_product
from marspec.errors import MarspecError

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the Q4_K kernel does not run here")


@pytest.mark.parametrize(("rows", "width"), [(64, 640), (33, 96), (40, 1000), (100, 1536)])
def test_the_product_is_the_int8_rows_own(rows: int, width: int) -> None:
    torch.manual_seed(rows + width)
    int8, scale = int8_rows(torch.randn(rows, width))
    bias = torch.randn(rows)
    layer = Int8PlanesLinear.from_int8_rows(int8, scale, bias)
    x = torch.randn(9, width) * 3.0
    expected = quantised_rows_product(x, int8.double() * scale.double()[:, None], bias)
    y = layer(x)
    assert y.shape == (9, rows) and y.dtype == torch.float32
    # Only float32's rounding of the scaled sums: the integer products are the int8 rows' exactly.
    assert torch.allclose(y.double(), expected, rtol=0.0, atol=1e-5 * expected.abs().max().item())


def test_the_extreme_weights_and_a_zero_row_are_exact() -> None:
    int8 = torch.tensor([[127] * 128, [-127] * 128, [0] * 128, list(range(-64, 64))], dtype=torch.int8)
    scale = torch.tensor([0.5, 0.25, 1.0, 2.0])
    layer = Int8PlanesLinear.from_int8_rows(int8, scale)
    x = torch.full((1, 128), 127.0)  # quantises to 127 everywhere: every product a whole number
    expected = quantised_rows_product(x, int8.double() * scale.double()[:, None])
    assert torch.equal(layer(x).double(), expected)


def test_each_row_is_computed_alone_and_the_tensors_rebuild_it() -> None:
    torch.manual_seed(0)
    layer = Int8PlanesLinear.from_int8_rows(*int8_rows(torch.randn(48, 640)))
    x = torch.randn(13, 640)
    together = layer(x)
    assert all(torch.equal(together[i], layer(x[i : i + 1])[0]) for i in range(13))
    again = Int8PlanesLinear(**layer.tensors)
    assert again.in_features == 640 and torch.equal(again(x), together)
    with pytest.raises(MarspecError, match="do not fit a layer 1000 wide"):
        Int8PlanesLinear(layer.blocks, 48, 1000)
    # A NaN row gives NaN, as a float layer would.
    assert torch.isnan(layer(torch.full((1, 640), float("nan")))).all()
