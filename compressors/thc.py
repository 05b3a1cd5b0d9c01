"""THC, Tensor Homomorphic Compression (Li et al.): non-uniform THC with its pre-processing
(Algorithms 2-3); Algorithm 1, Uniform THC, is compressors/thc_uniform.py.

One step of Algorithm 3 for worker i, on x_i = ∇_i + e_i (line 5, the error feedback):
 1. lines 7-8: the preliminary round, the max over workers of the norms, ℓ (allreduce MAX);
 2. line 9: the randomized Hadamard transform R = H·D·x (x zero-padded to a power of two
    d', D a Rademacher diagonal drawn from a seed all ranks share, H orthonormal), scaled
    by √d'/ℓ so coordinates are ≈ N(0, 1);
 3. lines 11-12: clamped to [−t_p, t_p], t_p = Φ⁻¹(1 − p/2) (M = −m = t_p in these units);
 4. lines 13-16: the clamped value mapped to the grid [0, g] and quantised stochastically
    (unbiased) onto the values of the optimal lookup table T (compressors.thc_table): the
    wire carries the b-bit index z, the aggregator sums the table VALUES T[z] (integers
    ≤ g), which is homomorphic: decompress(Σ T[z_i]) / n is the mean of the decompressed
    contributions (lines 17-19; the sum and the parameter server: compressors/integer_sum.py);
 5. lines 19-21: one decompression: the grid back to the real line, ×ℓ/√d', inverse RHT,
    truncated to d;
 6. line 22: error feedback keeps e = x − RHT⁻¹(X_i), the clamp AND the quantisation error,
    so `sent` is this worker's own decompressed contribution.
The noise of the rounding and the signs of D are the counter stream
(compressors/kernels/counter_stream.py). On the CPU steps 2-4 run as two fused passes of
the transform, and step 5 likewise (compressors/kernels/thc_pipeline.py: the same bits).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compressors.base import Context, DenseSent, Exchange, Outcome, Sent
from compressors.integer_sum import IntegerSum, affine_mean, dtype_name, per_chunk_
from compressors.kernels import ops, thc_pipeline
from compressors.kernels.counter_stream import draw_seed
from compressors.kernels.ops import fwht_, stream_noise, stream_signs
from compressors.registry import register
from compressors.requests import AllReduce
from compressors.thc_table import check_config, resolve_table, threshold


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def interval_lut(table: torch.Tensor) -> torch.Tensor:
    """For each grid integer i in [0, g], the interval j with T[j] ≤ i < T[j+1] (the last
    interval for i = g), int32. Table values are integers, so ⌊v⌋ picks v's interval."""
    k = table.numel() - 1
    points = torch.arange(int(table[-1]) + 1, dtype=table.dtype, device=table.device)
    return (table[None, :] <= points[:, None]).sum(1).sub_(1).clamp_(0, k - 1).to(torch.int32)


def table_encode(grid_values: torch.Tensor, table: torch.Tensor,
                 generator: torch.Generator | None = None, lut: torch.Tensor | None = None,
                 seed: int | None = None) -> torch.Tensor:
    """Stochastic quantisation of values in [0, g] onto the (float) table values, to the
    two neighbouring values with the probabilities that make it unbiased: E[T[z]] = v
    (lines 14-16). Overwrites `grid_values` (1-D); returns the indices z (int32). The noise
    is the counter stream keyed by `seed` (default: one seed drawn from `generator`).
    `lut`: interval_lut(table), if the caller caches it. (A lookup on ⌊v⌋: about 10x
    cheaper than the binary search of torch.searchsorted for 2^20 values on CPU.)"""
    if seed is None:
        if generator is None:
            raise ValueError("table_encode needs a generator or a seed for its noise")
        seed = draw_seed(generator)
    if lut is None:
        lut = interval_lut(table)
    j = lut.index_select(0, grid_values.to(torch.int32))
    gaps = table[1:] - table[:-1]
    frac = grid_values.sub_(table.index_select(0, j)).div_(gaps.index_select(0, j))
    noise = stream_noise(grid_values.numel(), seed, grid_values.device)
    return j.add_(noise < frac)


@dataclass
class RotatedGrid:
    """What all workers share in one THC step: the RHT's sign seed (the signs are the
    counter stream of `seed`, identical on every rank), the max norm ℓ and the
    quantisation grid; encodes a worker's vector and decodes summed table values. The
    fused passes generate the signs inside the transform; the torch steps materialise
    them once (`signs`)."""

    numel: int
    padded: int
    max_norm: float
    t_p: float
    granularity: int
    seed: int

    @classmethod
    def make(cls, numel: int, max_norm: float, p: float, granularity: int, seed: int,
             device=None) -> RotatedGrid:
        # `device` is accepted for compatibility: the signs are computed where needed.
        padded = next_power_of_two(numel)
        return cls(numel, padded, float(max_norm), threshold(p), granularity, int(seed))

    @functools.cached_property
    def _signs_by_device(self) -> dict[str, torch.Tensor]:
        return {}

    def signs(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The Rademacher diagonal D (padded length, float32 ±1) on `device`, cached."""
        key = str(torch.device(device))
        cache = self._signs_by_device
        if key not in cache:
            cache[key] = stream_signs(self.padded, self.seed, device)
        return cache[key]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """√d'/ℓ · H·D·x (zero-padded, float32): coordinates ≈ N(0, 1) (line 9): (x / ℓ)·s_i
        on the first numel coordinates, zeros after, then the unnormalised transform (the
        orthonormal one times √d': exactly the scale)."""
        x = x.reshape(-1).to(torch.float32)
        fused = thc_pipeline.rotate(self, x)
        if fused is not None:
            return fused
        buf = torch.zeros(self.padded, dtype=torch.float32, device=x.device)
        head = buf[: self.numel]
        torch.div(x, self.max_norm, out=head)
        head.mul_(self.signs(x.device)[: self.numel])
        return fwht_(buf, normalize=False)

    def encode(self, x: torch.Tensor, table: torch.Tensor, generator: torch.Generator,
               count_clamped: bool = False, lut: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, int | None]:
        """Table indices (int32, padded length) of x, and (if asked) how many
        coordinates were clamped. One noise seed is drawn from `generator`."""
        z, _, clamped = self.encode_values(x, table, generator, count_clamped=count_clamped,
                                           lut=lut)
        return z, clamped

    def encode_values(self, x: torch.Tensor, table: torch.Tensor, generator: torch.Generator,
                      table_values: torch.Tensor | None = None, indices: bool = True,
                      count_clamped: bool = False, lut: torch.Tensor | None = None,
                      values_out: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
        """THC's encoding of x, lines 9-16: rotate (pad, signs, FWHT, scale), clamp,
        stochastic rounding onto the float `table` with the noise of one seed drawn from
        `generator`. Returns (z: int32 indices or None when not `indices`; T[z] from
        `table_values` (the table in the sum's integer dtype), into `values_out` when
        given, or None; the clamped count or None)."""
        seed = draw_seed(generator)
        x32 = x.reshape(-1).to(torch.float32)
        lut = interval_lut(table) if lut is None else lut
        fused = thc_pipeline.rotate_encode(self, x32, table, table_values, lut, seed,
                                           indices, values_out, count_clamped)
        if fused is not None:
            z, values, clamped = fused
            return z, values, (clamped if count_clamped else None)
        rotated = self.rotate(x32)
        clamped = int((rotated.abs() > self.t_p).sum()) if count_clamped else None
        grid_values = rotated.clamp_(-self.t_p, self.t_p).add_(self.t_p)
        grid_values.mul_(self.granularity / (2 * self.t_p)).clamp_(0, self.granularity)
        z = table_encode(grid_values, table, lut=lut, seed=seed)
        values = None if table_values is None else torch.index_select(
            table_values, 0, z, out=values_out)
        return (z if indices else None), values, clamped

    def decode(self, value_sum: torch.Tensor, count: float | torch.Tensor, divisor: float,
               chunk_size: int = 0, zero_chunks: torch.Tensor | None = None,
               out: torch.Tensor | None = None, transient: bool = False) -> torch.Tensor:
        """(Σ of `count` workers' table values)/divisor back to the real line (float32,
        original length), lines 19-21: the single decompression. `count` may be per chunk
        of `chunk_size`; `zero_chunks` marks chunks whose aggregate was lost (set to 0).
        `out` (float32, original length): where the fused pass writes the result
        (Context.destination); the other paths return a tensor of their own.
        `transient=True`: the fused pass may return a view of its per-thread workspace,
        to be read before the thread's next THC call (no padded buffer)."""
        # grid value y ∈ [0, g] ↦ rotated coordinate y·2t_p/g − t_p ↦ ×ℓ/√d' ↦ H·(·)/√d'
        # (the orthonormal inverse): with the unnormalised transform, the factor is ℓ/d'.
        unit = self.max_norm / self.padded
        scale = 2 * self.t_p / self.granularity * unit
        offset = -self.t_p * unit
        if zero_chunks is None and not isinstance(count, torch.Tensor):  # one affine map
            fused = thc_pipeline.decode(self, value_sum, scale / divisor,
                                        offset * count / divisor, out, transient)
            if fused is not None:
                return fused
        out = affine_mean(value_sum, scale, offset, count, divisor, chunk_size)
        if zero_chunks is not None:
            per_chunk_(out, chunk_size, (~zero_chunks).to(out.dtype), "mul")
        fwht_(out, normalize=False)
        head = out[: self.numel]  # D⁻¹ = D, only where the result is kept
        if not thc_pipeline.unsign_(self, out):
            head.mul_(self.signs(out.device)[: self.numel])
        return head


@dataclass
class RotatedSent(Sent):
    """THC's own contribution RHT⁻¹(X_i) (line 22), decoded from this worker's table
    values when asked: error feedback subtracts it straight from the fused decode's
    per-thread workspace, with no padded buffer per step."""

    grid: RotatedGrid
    values: torch.Tensor  # T[Z_i], padded
    dtype: torch.dtype

    def subtract_from(self, buffer: torch.Tensor) -> None:
        buffer.sub_(self.grid.decode(self.values, 1, 1, transient=True).to(buffer.dtype))

    def dense(self, numel: int) -> torch.Tensor:
        return self.grid.decode(self.values, 1, 1).to(self.dtype)


@register("thc")
class THC(IntegerSum):
    """Non-uniform THC with RHT, support bounding and the optimal lookup table
    (Algorithm 3), paper defaults b = 4, g = 30, p = 1/32, 8-bit table sums.

    table: None for the optimal table of (bits, granularity, p) (stored in
    compressors/data/thc_tables.json, else solved on the fly), "symmetric" for the best
    mirror-symmetric one (the authors' published tables), or explicit values
    0 = T[0] < … < T[2^b − 1] = g.
    """

    default_feedback = "residual"

    def __init__(self, bits: int = 4, granularity: int = 30, p: float = 1 / 32,
                 table: str | Sequence[int] | None = None, sum_dtype: str = "uint8",
                 aggregation: str = "allreduce", loss_rate: float = 0.0,
                 loss_direction: str = "both", chunk_size: int = 256, stragglers: int = 0):
        check_config(bits, granularity, p)
        self.bits = bits
        self.granularity = granularity
        self.p = float(p)
        self.table = resolve_table(bits, granularity, self.p, table)
        self._init_aggregation(
            sum_dtype, aggregation, loss_rate, loss_direction, chunk_size, stragglers
        )
        self._tensors: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _max_value(self) -> int:
        return self.granularity

    def _overflow_message(self, workers: int, dtype: torch.dtype) -> str:
        top = torch.iinfo(dtype).max
        largest = top // workers
        msg = (
            f"thc: {workers} workers × granularity {self.granularity} = "
            f"{workers * self.granularity} overflows the {dtype_name(dtype)} table-value sums "
            f"(max {top}); the largest granularity that fits {workers} workers in "
            f"{dtype_name(dtype)} is g={largest}"
        )
        if largest < 2**self.bits - 1:
            msg += f", below 2^bits − 1 = {2**self.bits - 1}, so lower bits too"
        return msg + "; or set sum_dtype='int32'"

    def _table_tensors(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The table as float32 (encoding), as the sum dtype (aggregation) and its
        interval lookup, per device."""
        key = (str(device), dtype)
        cached = self._tensors.get(key)
        if cached is None:
            as_int = torch.tensor(self.table, dtype=dtype, device=device)
            as_float = as_int.to(torch.float32)
            cached = self._tensors[key] = (as_float, as_int, interval_lut(as_float))
        return cached

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        dtype = self._check_workers(ctx.world_size)
        numel = acc.numel()
        # Lines 7-8: the preliminary round, ||x_i||₂ in float64 (no overflow of the norm;
        # one native read pass where the kernels take acc). Every rank scales by the max.
        max_norm = float((yield AllReduce(ops.l2_norm(acc), op="max"))[0])
        padded = next_power_of_two(numel)
        if max_norm == 0.0:  # every worker's gradient is zero (the same decision on all ranks)
            return Outcome(aggregate=torch.zeros_like(acc), sent=DenseSent(torch.zeros_like(acc)),
                           extra={"d_padded": padded})
        grid = RotatedGrid.make(numel, max_norm, self.p, self.granularity, ctx.shared_seed)
        table_f, table_int, lut = self._table_tensors(acc.device, dtype)
        # Y_i = T[Z_i] (line 15) straight from the encoding pass, into a workspace kept per
        # tensor (read by error feedback at the end of the step); the indices themselves
        # only travel to a parameter server.
        indices, mine, clamped = grid.encode_values(
            acc, table_f, ctx.generator, table_values=table_int,
            indices=self.aggregation == "ps", count_clamped=ctx.measure, lut=lut,
            values_out=ctx.workspace("values", padded, dtype, acc.device),
        )
        got = yield from self._aggregate(indices, mine, table_int, dtype, ctx)
        aggregate = grid.decode(got.total, got.count, got.divisor, self.chunk_size, got.lost_down,
                                out=ctx.destination(numel, torch.float32, acc.device))
        extra = self._extra(got, dtype, padded)
        extra.update(d_padded=padded, max_norm=max_norm)
        if clamped is not None:
            extra["clamped"] = clamped / padded
        return Outcome(aggregate=aggregate.to(acc.dtype),
                       sent=RotatedSent(grid, mine, acc.dtype), extra=extra)

    def sent_elements(self, numel: int) -> int:
        return next_power_of_two(numel)
