"""THC's optimal lookup tables (THC Section 5.3 and Appendix B), solved exactly offline.

A table T maps a b-bit index to an integer value on a grid of g+1 points,
0 = T[0] < T[1] < … < T[2^b − 1] = g, where grid point i stands for the real number
a_i = −t_p + i·2t_p/g and t_p = Φ⁻¹(1 − p/2). THC quantises the (rotated, scaled,
clamped) coordinates stochastically onto {a_T[z]}; the table minimises the expected
variance of that quantisation for A ~ N(0, 1) truncated to [−t_p, t_p].

Objective, in closed form. Stochastic quantisation of a ∈ [l, r] onto the two
neighbours l, r (the variance-optimal unbiased choice, Ben Basat et al. 2021) has
variance (a − l)(r − a). With m0 = Φ(r) − Φ(l), m1 = ∫aφ = φ(l) − φ(r) and
m2 = ∫a²φ = m0 + lφ(l) − rφ(r),

    cost(l, r) = ∫_l^r (a − l)(r − a) φ(a) da = −m2 + (l + r)·m1 − l·r·m0,

and the variance of a table is Σ_k cost(a_T[k], a_T[k+1]) / (1 − p) (dividing by the
mass of [−t_p, t_p] makes it the variance under the truncated law; the argmin does not
change). Every interval endpoint is a grid point, so all costs form one (g+1)² matrix.

Search. The paper enumerates all monotone tables by stars and bars (Algorithm 5): there
are C(g − 1, 2^b − 2) of them (the paper's printed count, C(g − 3, 2^b − 2), drops two:
g − 2^b + 1 balls go into 2^b − 1 bins), e.g. 77,558,760 for b = 4, g = 30. Because the
objective is a sum over consecutive intervals, a shortest path over the grid with exactly
2^b − 1 steps finds the same optimum in O(2^b·g²) (`method="dp"`, the default, about a
millisecond); `method="enumerate"` scores every table in vectorised numpy chunks and is
kept as the paper's method and the cross-check of the DP.

Symmetry. The paper restricts odd g to mirror-symmetric tables (T[2^b − 1 − z] =
g − T[z]; its displayed formula T(z) = T(z + 2^{b−1}) − (g+1)/2 is a shift, which
contradicts its own sentence and its published tables, so the mirror reading is used).
The exact search shows this is not without loss: for b = 3, g = 17, p = 1/32 the best
symmetric table has variance 0.0665, the best table 0.0600. `symmetric=True` reproduces
the authors' procedure (and their published b=4, g=30 and b=3, g=16 tables);
the default searches all tables. For the paper's default b=4, g=30, p=1/32 the best table,
0,3,5,7,9,11,13,14,15,17,19,21,23,25,27,30 (variance 0.0134839), is not symmetric and
beats the authors' 0,3,…,13,14,16,17,…,30 (0.0134964) by 0.09%; THC uses the best
table by default and the authors' with table="symmetric".
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

TABLES_FILE = Path(__file__).parent / "data" / "thc_tables.json"
MAX_ENUMERATED = 20_000_000

# The configurations stored in data/thc_tables.json: the paper's defaults (b=4, g=30,
# p=1/32), the tables it prints (b=3, g=16), Fig. 8 (p=1/64: g=38/16 at b=4, g=8 at
# b=3), Fig. 9 (g=20, p=1/512, b=4), Fig. 10 (bits 2/3/4, p=1/32 and 1/1024, granularity
# swept): every g from 2^b − 1 to 51 (the largest g the paper found useful) for each.
STANDARD_BITS = (2, 3, 4)
STANDARD_P = (1 / 32, 1 / 64, 1 / 512, 1 / 1024)
STANDARD_MAX_GRANULARITY = 51


# The largest granularity g accepted: the table search holds (g + 1)² interval costs
# (g = 4096: 134 MB of float64), and a sum of n table values ≤ n·g must fit the wire.
MAX_GRANULARITY = 4096


def check_config(bits: int, granularity: int, p: float) -> None:
    """Refuse what has no table, naming the fix."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(
            f"bits={bits!r}: the bit budget per coordinate must be an integer in [1, 8]"
        )
    levels = 2**bits
    if isinstance(granularity, bool) or not isinstance(granularity, int):
        raise ValueError(
            f"granularity={granularity!r} must be an integer ≥ 2^bits − 1 = {levels - 1}"
        )
    if granularity < levels - 1:
        raise ValueError(
            f"granularity={granularity} is below 2^bits − 1 = {levels - 1}: {levels} strictly "
            f"increasing table values need at least {levels} grid points; raise granularity "
            "or lower bits"
        )
    if granularity > MAX_GRANULARITY:
        raise ValueError(
            f"granularity={granularity} is above {MAX_GRANULARITY}: the optimal table's "
            "search scores (g + 1)² intervals, and the workers' sums of table values must fit "
            "an integer wire (the paper uses g ≤ 38); lower granularity"
        )
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < float(p) < 1.0:
        raise ValueError(
            f"p={p!r} must lie in (0, 1): it is the expected fraction of coordinates clamped "
            "(the paper uses 1/32)"
        )


def parse_p(text: str | float) -> float:
    """'1/32', '0.03125' or a number → float."""
    if isinstance(text, (int, float)):
        return float(text)
    try:
        return float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"p={text!r} is not a number or a fraction like 1/32") from None


def threshold(p: float) -> float:
    """t_p = Φ⁻¹(1 − p/2): at most a p-fraction of N(0,1) falls outside [−t_p, t_p]."""
    return -statistics.NormalDist().inv_cdf(p / 2)


def grid(granularity: int, p: float) -> np.ndarray:
    """The g+1 real values a_i = −t_p + i·2t_p/g the table indexes into."""
    t = threshold(p)
    return -t + np.arange(granularity + 1, dtype=np.float64) * (2 * t / granularity)


def interval_costs(granularity: int, p: float) -> np.ndarray:
    """C[i, j] (i < j) = E-variance contribution of the interval [a_i, a_j] under the
    truncated normal; +inf where j ≤ i (no such interval)."""
    a = grid(granularity, p)
    cdf = np.array([0.5 * math.erfc(-x / math.sqrt(2)) for x in a])
    pdf = np.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    left, right = a[:, None], a[None, :]
    m0 = cdf[None, :] - cdf[:, None]
    m1 = pdf[:, None] - pdf[None, :]
    apdf = a * pdf
    m2 = m0 + apdf[:, None] - apdf[None, :]
    cost = (-m2 + (left + right) * m1 - left * right * m0) / (1.0 - p)
    cost[np.tril_indices(granularity + 1)] = np.inf
    return cost


def table_variance(tables: Any, granularity: int, p: float, costs: np.ndarray | None = None) -> Any:
    """Variance of quantising the truncated normal onto one table (a float) or onto each
    row of a 2-D array of tables (an array)."""
    c = interval_costs(granularity, p) if costs is None else costs
    t = np.asarray(tables, dtype=np.int64)
    v = c[t[..., :-1], t[..., 1:]].sum(-1)
    return float(v) if t.ndim == 1 else v


def count_tables(bits: int, granularity: int, symmetric: bool = False) -> int:
    """How many monotone tables the search space holds (stars and bars)."""
    levels = 2**bits
    if symmetric:
        half = levels // 2
        return math.comb(_lower_half_limit(granularity) - 1, half - 1) if bits > 1 else 1
    return math.comb(granularity - 1, levels - 2)


def _lower_half_limit(granularity: int) -> int:
    """Lower-half values of a mirror-symmetric table lie below g/2: in [0, this)."""
    return (granularity + 1) // 2


def enumerate_tables(
    bits: int, granularity: int, symmetric: bool = False, chunk: int = 1 << 18
) -> Iterator[np.ndarray]:
    """Every strictly increasing table 0 = T[0] < … < T[2^b−1] = g (mirror-symmetric ones
    only if `symmetric`), as int64 arrays of up to `chunk` rows. Choosing the interior
    values is the stars-and-bars placement of the bars."""
    levels = 2**bits
    if symmetric:
        half = levels // 2
        pool = range(1, _lower_half_limit(granularity))
        width = half - 1
    else:
        pool = range(1, granularity)
        width = levels - 2
    zero = np.zeros((1, 1), dtype=np.int64)
    if width == 0:  # bits = 1, or the lower half of a symmetric 2-entry table: one table
        lower = zero
        yield np.concatenate([lower, granularity - lower[:, ::-1]], axis=1)
        return
    combos = itertools.combinations(pool, width)
    while True:
        flat = np.fromiter(
            itertools.chain.from_iterable(itertools.islice(combos, chunk)), dtype=np.int64
        )
        if flat.size == 0:
            return
        inner = flat.reshape(-1, width)
        zeros = np.zeros((inner.shape[0], 1), dtype=np.int64)
        if symmetric:
            lower = np.concatenate([zeros, inner], axis=1)
            yield np.concatenate([lower, granularity - lower[:, ::-1]], axis=1)
        else:
            yield np.concatenate([zeros, inner, zeros + granularity], axis=1)


@dataclass(frozen=True)
class SolvedTable:
    bits: int
    granularity: int
    p: float
    t_p: float
    table: tuple[int, ...]
    variance: float
    symmetric: bool
    method: str
    candidates: int
    seconds: float

    def record(self) -> dict[str, Any]:
        """What data/thc_tables.json stores for it."""
        d = asdict(self)
        d["table"] = list(self.table)
        for k in ("symmetric", "method", "candidates", "seconds"):
            d.pop(k)
        return d


def _canonical(
    table: tuple[int, ...], granularity: int, p: float, costs: np.ndarray
) -> tuple[int, ...]:
    """Of a table and its mirror image (equal variance by the symmetry of φ, up to
    rounding), the lexicographically smaller: a deterministic answer for tied optima."""
    mirror = tuple(granularity - v for v in reversed(table))
    if mirror < table:
        v_t = table_variance(table, granularity, p, costs)
        v_m = table_variance(mirror, granularity, p, costs)
        if v_m <= v_t * (1 + 1e-9):
            return mirror
    return table


def _solve_dp(bits: int, granularity: int, costs: np.ndarray, symmetric: bool) -> tuple[int, ...]:
    levels = 2**bits
    n = granularity + 1
    if symmetric:
        # Lower half: 0 = T[0] < … < T[h−1] = s < g/2 in h−1 steps; the upper half is its
        # mirror (same cost), joined by the middle interval [s, g − s].
        steps = levels // 2 - 1
        limit = _lower_half_limit(granularity)
        sub = costs[:limit, :limit]
    else:
        steps = levels - 1
        sub = costs
    m = sub.shape[0]
    best = np.full(m, np.inf)
    best[0] = 0.0
    back = []
    for _ in range(steps):
        total = best[:, None] + sub  # total[i, j]: reach i, then step to j
        arg = total.argmin(axis=0)
        back.append(arg)
        best = total[arg, np.arange(m)]
    if symmetric:
        s_values = np.arange(m)
        joined = 2 * best + costs[s_values, granularity - s_values]
        end = int(np.argmin(joined))
    else:
        end = granularity
    path = [end]
    for arg in reversed(back):
        path.append(int(arg[path[-1]]))
    lower = tuple(reversed(path))
    if symmetric:
        return lower + tuple(granularity - v for v in reversed(lower))
    return lower


def _solve_enumerate(
    bits: int, granularity: int, costs: np.ndarray, symmetric: bool, limit: int
) -> tuple[int, ...]:
    total = count_tables(bits, granularity, symmetric)
    if total > limit:
        raise ValueError(
            f"enumerating {total:,} tables for bits={bits}, granularity={granularity} exceeds "
            f"the limit of {limit:,}; use method='dp' (exact, same optimum) or symmetric=True"
        )
    best_v, best_t = np.inf, None
    for tables in enumerate_tables(bits, granularity, symmetric):
        v = costs[tables[:, :-1], tables[:, 1:]].sum(1)
        i = int(np.argmin(v))
        if v[i] < best_v:
            best_v, best_t = float(v[i]), tuple(int(x) for x in tables[i])
    assert best_t is not None
    return best_t


def solve(
    bits: int,
    granularity: int,
    p: float,
    symmetric: bool = False,
    method: str = "dp",
    max_enumerated: int = MAX_ENUMERATED,
) -> SolvedTable:
    """The table of least variance for (b, g, p): exact over all monotone tables, or over
    the mirror-symmetric ones with `symmetric=True`."""
    check_config(bits, granularity, p)
    if method not in ("dp", "enumerate"):
        raise ValueError(
            f"method={method!r}: choose 'dp' (exact, fast) or 'enumerate' (the paper's)"
        )
    p = float(p)
    start = time.perf_counter()
    costs = interval_costs(granularity, p)
    if method == "dp":
        table = _solve_dp(bits, granularity, costs, symmetric)
    else:
        table = _solve_enumerate(bits, granularity, costs, symmetric, max_enumerated)
    if not symmetric:
        table = _canonical(table, granularity, p, costs)
    seconds = time.perf_counter() - start
    return SolvedTable(
        bits=bits,
        granularity=granularity,
        p=p,
        t_p=threshold(p),
        table=table,
        variance=table_variance(table, granularity, p, costs),
        symmetric=symmetric,
        method=method,
        candidates=count_tables(bits, granularity, symmetric),
        seconds=seconds,
    )


# ---------------------------------------------------------------------------------------
# The stored tables.
# ---------------------------------------------------------------------------------------


def _same_p(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _same_config(record: dict[str, Any], bits: int, granularity: int, p: float) -> bool:
    same_grid = record["bits"] == bits and record["granularity"] == granularity
    return same_grid and _same_p(record["p"], p)


@functools.lru_cache(maxsize=1)
def _stored() -> tuple[dict[str, Any], ...]:
    try:
        text = resources.files("compressors").joinpath("data/thc_tables.json").read_text()
    except FileNotFoundError:
        return ()
    return tuple(json.loads(text)["tables"])


def stored_tables() -> list[dict[str, Any]]:
    """The records of data/thc_tables.json."""
    return [dict(r) for r in _stored()]


def stored_table(bits: int, granularity: int, p: float) -> tuple[int, ...] | None:
    for r in _stored():
        if _same_config(r, bits, granularity, p):
            return tuple(r["table"])
    return None


@functools.lru_cache(maxsize=256)
def _solved(bits: int, granularity: int, p: float, symmetric: bool) -> tuple[int, ...]:
    return solve(bits, granularity, p, symmetric=symmetric).table


def get_table(bits: int, granularity: int, p: float, symmetric: bool = False) -> tuple[int, ...]:
    """The optimal table for (b, g, p): the stored one, else solved now (and cached)."""
    check_config(bits, granularity, p)
    if not symmetric:
        table = stored_table(bits, granularity, float(p))
        if table is not None:
            return table
    return _solved(bits, granularity, float(p), symmetric)


def resolve_table(bits: int, granularity: int, p: float,
                  table: str | Sequence[int] | None = None) -> tuple[int, ...]:
    """The table THC(table=...) uses: None for the optimal table of (bits, granularity, p),
    "symmetric" for the best mirror-symmetric one (the authors' published tables), or
    explicit values, checked: 2^b strictly increasing integers from 0 to g."""
    if table is None:
        return get_table(bits, granularity, p)
    if isinstance(table, str):
        if table != "symmetric":
            raise ValueError(
                f"table={table!r}: give None (optimal), 'symmetric' or the table values"
            )
        return get_table(bits, granularity, p, symmetric=True)
    values = tuple(int(v) for v in table)
    size = 2**bits
    if (
        len(values) != size
        or values[0] != 0
        or values[-1] != granularity
        or any(b <= a for a, b in zip(values, values[1:]))
    ):
        raise ValueError(
            f"table={list(table)!r} must hold {size} strictly increasing integers from 0 to "
            f"granularity={granularity} (0 = T[0] < … < T[{size - 1}] = g)"
        )
    return values


def standard_configs() -> list[tuple[int, int, float]]:
    return [
        (b, g, p)
        for p in STANDARD_P
        for b in STANDARD_BITS
        for g in range(2**b - 1, STANDARD_MAX_GRANULARITY + 1)
    ]


def write_tables(solved: list[SolvedTable], path: Path = TABLES_FILE) -> int:
    """Insert or replace these tables in the JSON file (one record a line, sorted);
    returns how many records the file holds."""
    records: list[dict[str, Any]] = []
    if path.exists():
        records = json.loads(path.read_text())["tables"]
    for s in solved:
        if s.symmetric:
            raise ValueError("only the unconstrained optimum is stored; solve with symmetric=False")
        rec = s.record()
        records = [r for r in records if not _same_config(r, s.bits, s.granularity, s.p)]
        records.append(rec)
    records.sort(key=lambda r: (-r["p"], r["bits"], r["granularity"]))
    header = {
        "description": (
            "THC lookup tables T_{b,g,p} (Appendix B): the table of least variance for "
            "stochastically quantising N(0,1) truncated to [-t_p, t_p] onto the grid "
            "points -t_p + T[z]*2t_p/g, over all monotone tables (exact dynamic programme)."
        ),
        "generated_by": "repro thc-table --bits B --granularity G --p P --write",
    }
    lines = [json.dumps(header)[:-1] + ', "tables": [']
    lines += [json.dumps(r) + ("," if i < len(records) - 1 else "") for i, r in enumerate(records)]
    lines.append("]}")
    from repro.durable import write_text  # the suite's one writer (run by `repro thc-table`)

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "\n".join(lines) + "\n")
    _stored.cache_clear()
    return len(records)
