"""Encode times of two builds of the native library side by side in one process
(results/bench/README.md, "Ninth session").

    python scripts/bench_native_ab.py --old-rev HEAD~1 [--new-rev WORKTREE]
        [--compressor sidco_p,sidco_e] [--numel 26M] [--steps 26]
        [--decode-workers 2,8,16 --decode-numel 16777216 --decode-order ascending]
        [--json FILE]

Each revision's compressors/_native sources (WORKTREE: the files as they are now) are
compiled with the flags the package uses into a temporary folder; both libraries are
loaded, and one single-worker Session per library (no error feedback, no NaN/Inf check, as
`repro bench` times encoders) compresses the same Laplace tensor step after step, the
library swapped in before each call and the order of the two alternating from step to
step. Medians over the steps after the first three, and the floor (a sum of a precomputed
|x|) timed between them. With --decode-workers, also the batched sparse decode
(_native.scatter_mean) of K ranks' selections of δ = 0.001 of --decode-numel elements
each, ascending as dragonn-fig5b builds them, or (--decode-order random) in the random
order of repro bench's payloads. Both builds must have the ABI version of
the checkout; `--compressor ''` times only the decode."""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import compressors
from compressors import Session, _native
from repro import bench, sources

ROOT = Path(__file__).resolve().parent.parent


def build(rev: str, folder: Path) -> ctypes.CDLL:
    """The library compiled from `rev`'s sources (WORKTREE: the files on disk)."""
    src = folder / rev.replace("/", "_").replace("~", "-")
    src.mkdir()
    for name in _native.SOURCES + _native.HEADERS:
        path = f"compressors/_native/{name}"
        if rev == "WORKTREE":
            text = (ROOT / path).read_bytes()
        else:
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                                  capture_output=True).stdout
        (src / name).write_bytes(text)
    compiler = _native._compiler()
    if compiler is None:
        raise SystemExit("no C++ compiler found (set CXX, or install g++)")
    target = src / "lib.so"
    cmd = [compiler, *_native._BASE_FLAGS, "-march=native", "-fopenmp",
           *(str(src / name) for name in _native.SOURCES), "-o", str(target)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(target))
    _native._declare(lib)
    if lib.gc_abi_version() != _native.ABI_VERSION:
        raise SystemExit(f"{rev}: ABI version {lib.gc_abi_version()}, this checkout's is "
                         f"{_native.ABI_VERSION}: compare revisions with the same ABI, or "
                         "whole revisions with scripts/bench_revisions_ab.py")
    return lib


def side_by_side(name: str, x: torch.Tensor, libs: dict, steps: int) -> dict:
    magnitudes = x.abs()
    dest = torch.empty_like(x)
    sessions = {k: Session(compressors.build(name, ratio=0.001), feedback="none",
                           check_finite=False, measure=False) for k in libs}
    times: dict[str, list[float]] = {k: [] for k in (*libs, "floor")}
    order = list(libs)
    for step in range(steps):
        for key in (order if step % 2 == 0 else order[::-1]):
            _native._lib = libs[key]
            _, encode, _ = bench.exchange_once(sessions[key], x, step, out=dest)
            if step >= 3:
                times[key].append(encode)
        t0 = time.perf_counter()
        torch.sum(magnitudes)
        times["floor"].append(time.perf_counter() - t0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"compressor": name, **{f"{k}_ms": v for k, v in ms.items()},
            "old_over_new": ms["old"] / ms["new"], "new_over_floor": ms["new"] / ms["floor"],
            "timed_steps": steps - 3}


def decode_side_by_side(numel: int, workers: list[int], libs: dict, steps: int,
                        order: str = "ascending") -> list[dict]:
    g = torch.Generator().manual_seed(0)
    k = max(1, int(numel * 0.001))
    payloads = {}
    for K in workers:
        if order == "random":  # repro bench's payloads (Top-k's order)
            idx, val = bench.sparse_payloads(numel, k, K, seed=0)
            payloads[K] = (torch.cat(idx), torch.cat(val))
            continue
        idx = torch.cat([torch.randperm(numel, generator=g)[:k].sort().values for _ in range(K)])
        payloads[K] = (idx, torch.randn(K * k, generator=g))
    out = torch.empty(numel)
    times = {(key, K): [] for key in libs for K in workers}
    order = list(libs)
    for step in range(steps):
        for key in (order if step % 2 == 0 else order[::-1]):
            _native._lib = libs[key]
            for K, (idx, val) in payloads.items():
                t0 = time.perf_counter()
                _native.scatter_mean(idx, val, out, K)
                if step >= 3:
                    times[(key, K)].append(time.perf_counter() - t0)
    rows = []
    for K in workers:
        ms = {key: 1e3 * statistics.median(times[(key, K)]) for key in libs}
        rows.append({"decode_workers": K, "numel": numel, "order": order, "old_ms": ms["old"],
                     "new_ms": ms["new"], "old_over_new": ms["old"] / ms["new"]})
    return rows


def resolve(rev: str) -> str:
    """A revision as its commit hash (WORKTREE as it is)."""
    if rev == "WORKTREE":
        return rev
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-rev", required=True)
    parser.add_argument("--new-rev", default="WORKTREE")
    parser.add_argument("--compressor", default="sidco_p,sidco_e")
    parser.add_argument("--numel", default="26M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=26)
    parser.add_argument("--decode-workers", default="",
                        help="K values for the batched decode (e.g. 2,8,16); none by default")
    parser.add_argument("--decode-numel", type=int, default=16_777_216)
    parser.add_argument("--decode-order", choices=["ascending", "random"], default="ascending",
                        help="each rank's indices ascending (a threshold sparsifier's, "
                             "dragonn-fig5b's) or in random order (repro bench's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.old_rev, args.new_rev = resolve(args.old_rev), resolve(args.new_rev)
    if _native.load() is None:
        raise SystemExit(f"native kernels unavailable: {_native.error()}")
    names = [name for name in args.compressor.split(",") if name]
    workers = [int(k) for k in args.decode_workers.split(",") if k]
    for name in names:
        compressors.build(name, ratio=0.001)  # an unknown name fails before any build
    torch.set_num_threads(args.threads)
    x = sources.synthetic("laplace", bench.parse_size(args.numel) if names else 1, 1, 0, 0)[0]
    rows = []
    own = _native._lib
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": build(args.old_rev, Path(tmp)), "new": build(args.new_rev, Path(tmp))}
        print(f"old = {args.old_rev}, new = {args.new_rev}; {args.threads} threads, medians of "
              f"{args.steps - 3} steps" + (f"; {x.numel()} float32 elements" if names else ""))
        try:
            for name in names:
                r = side_by_side(name, x, libs, args.steps)
                rows.append(r)
                print(f"{name}: old {r['old_ms']:.2f} ms, new {r['new_ms']:.2f} ms, old / new "
                      f"{r['old_over_new']:.3f}; floor {r['floor_ms']:.2f} ms, new / floor "
                      f"{r['new_over_floor']:.2f}", flush=True)
            if workers:
                decode = decode_side_by_side(args.decode_numel, workers, libs, args.steps,
                                             args.decode_order)
                rows.extend(decode)
                for r in decode:
                    print(f"decode K={r['decode_workers']}: old {r['old_ms']:.3f} ms, new "
                          f"{r['new_ms']:.3f} ms, old / new {r['old_over_new']:.3f}")
                for key in ("old", "new"):
                    ms = {r["decode_workers"]: r[f"{key}_ms"] for r in decode}
                    growth = ", ".join(f"K={K}/K={workers[0]} {ms[K] / ms[workers[0]]:.3f}"
                                       for K in workers[1:])
                    print(f"decode growth, {key}: {growth}")
        finally:
            _native._lib = own
    if args.json:
        Path(args.json).write_text(json.dumps({"old": args.old_rev, "new": args.new_rev,
                                               "threads": args.threads, "rows": rows},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
