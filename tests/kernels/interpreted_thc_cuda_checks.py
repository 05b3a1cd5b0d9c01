"""THC's Triton kernels (compressors/kernels/cuda_thc.py) run by Triton's CPU interpreter on
CPU tensors, against the torch steps of compressors/thc.py (bit for bit): the rotation, the
encoding (indices, table values, clamped count), the decoding and the sign flip, on the
default transform plan and on multi-pass plans of small sizes, and whole THC steps through
the compressor API. Not collected by default (the file name): tests/kernels/test_thc_cuda_kernel.py
runs it in a fresh Python with TRITON_INTERPRET=1 (set before triton is first imported)
and GRADCOMP_NATIVE=0 (the CPU library declines the tensors, so the kernels take them)."""

from __future__ import annotations

import sys

import pytest
import torch

import compressors
from compressors import SimulatedGroup
from compressors.kernels import cuda_thc, ops, thc_pipeline
from compressors.thc import RotatedGrid, interval_lut
from compressors.thc_table import resolve_table

if not cuda_thc.INTERPRETED or ops.available():
    raise RuntimeError("run with TRITON_INTERPRET=1 and GRADCOMP_NATIVE=0 "
                       "(tests/kernels/test_thc_cuda_kernel.py does)")

# small transform plans: three passes (a block, a middle pass, the finishing tile) at 2^12
SMALL = {"block": 64, "tile": 256, "min_columns": 8}
SIZES = [1, 5, 31, 32, 33, 1000, 4096, 5000]
SEED = 0xDEADBEEFCAFEBABE


@pytest.fixture
def torch_steps(monkeypatch):
    """Runs a function with the pipeline's kernels declined (thc.py's torch steps)."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(thc_pipeline, "_device_kernels", lambda *tensors: None)
            return fn()
    return run


def _laplace(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)


def _grid(x: torch.Tensor, p: float = 1 / 32, granularity: int = 30) -> RotatedGrid:
    # ℓ below the norm: more coordinates beyond t_p than the max norm of one worker gives
    return RotatedGrid.make(x.numel(), float(x.norm()) * 0.7 + 1e-6, p, granularity, SEED)


def _tables(bits: int, granularity: int, p: float, dtype: torch.dtype):
    values = torch.tensor(resolve_table(bits, granularity, p, None), dtype=dtype)
    table = values.to(torch.float32)
    return table, values, interval_lut(table)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sizes", [{}, SMALL], ids=["default", "small"])
def test_rotation(torch_steps, n, sizes):
    x = _laplace(n, n)
    grid = _grid(x)
    want = torch_steps(lambda: grid.rotate(x))
    got = cuda_thc.rotate(x, grid.padded, grid.max_norm, grid.seed, **sizes)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(grid.rotate(x), want)  # the pipeline takes the kernels


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sizes", [{}, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("bits, granularity, p, dtype", [
    (4, 30, 1 / 32, torch.uint8), (2, 8, 1 / 8, torch.int32), (8, 255, 1 / 512, torch.int64)])
def test_encoding(torch_steps, n, sizes, bits, granularity, p, dtype):
    x = _laplace(n, 3 * n + bits)
    grid = _grid(x, p, granularity)
    table, values, lut = _tables(bits, granularity, p, dtype)
    gen = torch.Generator().manual_seed(n)
    state = gen.get_state()
    z, val, clamped = torch_steps(lambda: grid.encode_values(
        x, table, gen, table_values=values, count_clamped=True, lut=lut))
    gen.set_state(state)
    seed = compressors.kernels.counter_stream.draw_seed(gen)
    got_z, got_val, got_clamped = cuda_thc.rotate_encode(
        x, grid.padded, grid.max_norm, grid.seed, grid.t_p, granularity, table, lut, seed,
        table_values=values, **sizes)
    assert got_z.dtype == torch.int32 and torch.equal(got_z, z)
    assert got_val.dtype == dtype and torch.equal(got_val, val)
    assert got_clamped == clamped
    if n >= 1000:
        assert 0 < clamped < grid.padded // 2
    assert int(z.min()) >= 0 and int(z.max()) <= 2**bits - 1


@pytest.mark.parametrize("n", [5, 4096, 5000])
def test_encoding_through_the_pipeline(torch_steps, n):
    # indices only, values only (into a given buffer), with and without the count
    x = _laplace(n, n + 7)
    grid = _grid(x)
    table, values, lut = _tables(4, 30, 1 / 32, torch.uint8)

    def run(**kw):
        return grid.encode_values(x, table, torch.Generator().manual_seed(1), lut=lut, **kw)

    for kw in ({"count_clamped": True}, {"table_values": values, "indices": False}):
        want = torch_steps(lambda: run(**kw))
        got = run(**kw)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(got, want)), kw
    out = torch.full((grid.padded,), 77, dtype=torch.uint8)
    z, got, clamped = run(table_values=values, values_out=out, indices=False)
    assert z is None and clamped is None and got is out
    assert torch.equal(out, torch_steps(lambda: run(table_values=values))[1])


def test_count_can_be_left_out():
    x = _laplace(300, 1)
    grid = _grid(x)
    table, values, lut = _tables(4, 30, 1 / 32, torch.uint8)
    full = cuda_thc.rotate_encode(x, grid.padded, grid.max_norm, grid.seed, grid.t_p, 30,
                                  table, lut, 5, table_values=values)
    bare = cuda_thc.rotate_encode(x, grid.padded, grid.max_norm, grid.seed, grid.t_p, 30,
                                  table, lut, 5, indices=False, table_values=values,
                                  count=False)
    assert bare[0] is None and bare[2] is None and torch.equal(bare[1], full[1])
    z_only = cuda_thc.rotate_encode(x, grid.padded, grid.max_norm, grid.seed, grid.t_p, 30,
                                    table, lut, 5)
    assert z_only[1] is None and torch.equal(z_only[0], full[0]) and z_only[2] == full[2]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sizes", [{}, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_decoding(torch_steps, n, sizes, dtype):
    grid = _grid(_laplace(n, n))
    g = torch.Generator().manual_seed(n)
    total = torch.randint(0, 3 * 30 + 1, (grid.padded,), generator=g).to(dtype)
    count, divisor = 3, 4
    want = torch_steps(lambda: grid.decode(total, count, divisor))
    unit = grid.max_norm / grid.padded
    scale = 2 * grid.t_p / grid.granularity * unit
    a, b = scale / divisor, -grid.t_p * unit * count / divisor
    got = cuda_thc.decode(total, n, a, b, grid.seed, **sizes)
    assert got.shape == (n,) and torch.equal(got, want)
    out = torch.full((n,), float("nan"))
    assert cuda_thc.decode(total, n, a, b, grid.seed, out=out, **sizes) is out
    assert torch.equal(out, want)
    # through the pipeline, with and without a destination
    assert torch.equal(grid.decode(total, count, divisor), want)
    out.fill_(float("nan"))
    assert grid.decode(total, count, divisor, out=out) is out and torch.equal(out, want)


@pytest.mark.parametrize("n", [1, 31, 1000, 5000])
def test_sign_flip(torch_steps, n):
    grid = _grid(_laplace(n, n))
    x = _laplace(grid.padded, 2 * n)
    want = x.clone()
    want[:n].mul_(grid.signs()[:n])
    got = x.clone()
    assert thc_pipeline.unsign_(grid, got) and torch.equal(got, want)
    assert torch_steps(lambda: thc_pipeline.unsign_(grid, x.clone())) is False


def test_chunked_decoding_unsigns_with_the_kernel(torch_steps):
    # per-chunk counts and lost chunks: the torch affine map, then the kernel's sign flip
    n = 3000
    grid = _grid(_laplace(n, 0))
    total = torch.randint(0, 61, (grid.padded,), generator=torch.Generator().manual_seed(3),
                          dtype=torch.int32)
    chunks = -(-grid.padded // 256)
    count = torch.full((chunks,), 2, dtype=torch.int64)  # (a float32 count is scaled in place)
    count[3] = 1
    lost = torch.zeros(chunks, dtype=torch.bool)
    lost[5] = True
    want = torch_steps(lambda: grid.decode(total, count, 2, 256, lost))
    assert torch.equal(grid.decode(total, count, 2, 256, lost), want)


@pytest.mark.parametrize("name, params, n", [
    ("thc", {}, 5000),
    ("thc", {}, 20),
    ("thc", {"aggregation": "ps", "loss_rate": 0.05}, 3000),
    ("thc", {"bits": 8, "granularity": 255, "sum_dtype": "int32"}, 4097),
])
def test_whole_steps_equal_the_torch_steps(torch_steps, monkeypatch, name, params, n):
    """THC through the compressor API (3 workers, error feedback, 2 steps): the same
    aggregates and sent vectors with the kernels as with thc.py's torch steps, and the
    kernels taken."""
    grads = [_laplace(n, r) for r in range(3)]

    def run():
        group = SimulatedGroup(compressors.build(name, **params), 3, seed=5)
        return [group.step(grads) for _ in range(2)]

    expected = torch_steps(run)
    calls = []
    for fn in ("rotate_encode", "decode"):
        real = getattr(cuda_thc, fn)
        monkeypatch.setattr(cuda_thc, fn, lambda *a, _f=real, _n=fn, **k: calls.append(_n)
                            or _f(*a, **k))
    got = run()
    assert "rotate_encode" in calls and "decode" in calls
    for step_got, step_exp in zip(got, expected):
        for o, e in zip(step_got, step_exp):
            assert torch.equal(o.aggregate, e.aggregate)
            assert torch.equal(o.sent.dense(n), e.sent.dense(n))
            assert o.extra == e.extra


if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", __file__]))
