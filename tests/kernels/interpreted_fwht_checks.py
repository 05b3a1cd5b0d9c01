"""The Triton transform of compressors/kernels/cuda_fwht.py run by Triton's CPU interpreter
on CPU tensors, against reference.fwht_ (bit for bit: the same butterflies in the same
order) and against scipy.linalg.hadamard in float64. Not collected by default (the file
name): tests/kernels/test_fwht_kernel.py runs it as a script (pytest on this file) in a fresh
Python with TRITON_INTERPRET=1, which must be set before triton is first imported."""

from __future__ import annotations

import sys

import pytest
import torch
from scipy.linalg import hadamard

from compressors.kernels import cuda as kernels
from compressors.kernels import cuda_fwht, reference

if not kernels.INTERPRETED:
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/kernels/test_fwht_kernel.py does)")


def _rows(rows: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g, dtype=torch.float32)


def _sylvester(x: torch.Tensor) -> torch.Tensor:
    """hadamard(d) @ row for every row, in float64: H_d = H_a ⊗ H_b (d = a·b), so a row
    viewed as an (a, b) matrix X goes to H_a · X · H_b, with no d × d matrix."""
    rows, d = x.shape
    a = 1 << ((d.bit_length() - 1) // 2)
    b = d // a
    ha = torch.from_numpy(hadamard(a)).to(torch.float64)
    hb = torch.from_numpy(hadamard(b)).to(torch.float64)
    return (ha @ x.to(torch.float64).reshape(rows, a, b) @ hb).reshape(rows, d)


def _check(x: torch.Tensor, **sizes) -> None:
    got = x.clone()
    assert cuda_fwht.fwht_(got, **sizes) is got  # in place
    assert torch.equal(got, reference.fwht_(x.clone()))
    d = x.shape[-1]
    want = _sylvester(x)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * d ** 0.5 * (d.bit_length()))


@pytest.mark.parametrize("d", [1, 2, 64, 1 << 12, 1 << 14, 1 << 17])
@pytest.mark.parametrize("rows", [1, 3])
def test_default_plan_equals_reference_and_scipy(d, rows):
    _check(_rows(rows, d, seed=d + rows))


def test_scipy_order_on_a_small_matrix():
    # the identity's rows transform into hadamard(d)'s columns (= its rows: symmetric)
    d = 32
    eye = torch.eye(d, dtype=torch.float32)
    got = cuda_fwht.fwht_(eye.clone())
    assert torch.equal(got, torch.from_numpy(hadamard(d)).to(torch.float32))


# (d, rows, block, tile, min_columns, passes): multi-pass plans on small d, with rows
# spanning blocks (d < block, a ragged last block), strided passes whose columns are
# fewer than min_columns (Q small), and uneven splits of the remaining factor
PLANS = [
    (1 << 10, 3, 16, 32, 4, 3),
    (1 << 12, 2, 64, 64, 8, 3),
    (1 << 13, 1, 16, 64, 4, 4),
    (1 << 11, 5, 32, 512, 8, 2),
    (1 << 9, 2, 4, 32, 8, 5),
    (16, 7, 64, 32, 4, 1),
    (64, 5, 32, 32, 4, 2),
]


@pytest.mark.parametrize("d, rows, block, tile, min_columns, passes", PLANS)
def test_multi_pass_plans_equal_reference_and_scipy(d, rows, block, tile, min_columns, passes):
    sizes = {"block": block, "tile": tile, "min_columns": min_columns}
    steps = cuda_fwht.plan(d, rows * d, **sizes)
    assert len(steps) == passes
    m = 1
    for step in steps:
        assert step.q == m and step.m * max(step.outer, step.columns) <= max(block, tile)
        m *= step.m
    assert m == d
    _check(_rows(rows, d, seed=d ^ rows), **sizes)


def test_rejects_what_it_does_not_take():
    with pytest.raises(ValueError, match="power-of-two"):
        cuda_fwht.fwht_(torch.zeros(2, 12))
    with pytest.raises(TypeError):
        cuda_fwht.fwht_(torch.zeros(2, 16, dtype=torch.float64))


if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", __file__]))
