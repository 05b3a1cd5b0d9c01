"""`repro bench`: encode/decode latency of compressors over tensor sizes and ratios, against
a one-pass floor and exact Top-k, plus batched vs dense per-rank sparse decoding
(SIDCo Figs. 16–17, DRAGONN Fig. 5; library: repro.bench)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(sub) -> None:
    from repro.bench import (
        DEFAULT_BUDGET_S,
        DEFAULT_COMPRESSORS,
        DEFAULT_DECODE_WORKERS,
        DEFAULT_RATIOS,
        DEFAULT_REPEATS,
        DEFAULT_SIZES,
        DEFAULT_SOURCE,
        DEFAULT_THREADS,
        QUICK_DECODE_WORKERS,
        QUICK_RATIOS,
        QUICK_REPEATS,
        QUICK_SIZES,
    )
    from repro.cli import DefaultsFormatter

    def ints(text: str) -> list[int]:
        try:
            return [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None

    def floats(text: str) -> list[float]:
        try:
            return [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from None

    p = sub.add_parser(
        "bench",
        help="encode/decode latency over sizes and ratios (SIDCo Fig. 16-17, DRAGONN Fig. 5)",
        description=(
            "Median encode and decode time of compressors on synthetic tensors, each also "
            "given over one read pass of the tensor (sum of |x|) and over exact Top-k at the "
            "same size and ratio, and batched sparse decoding vs dense per-rank decoding over "
            "K workers. --quick: sizes "
            f"{','.join(map(str, QUICK_SIZES))}, ratios {','.join(map(str, QUICK_RATIOS))}, "
            f"K {','.join(map(str, QUICK_DECODE_WORKERS))}, {QUICK_REPEATS} repeats."
        ),
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--compressor", action="append", metavar="NAME[,NAME...]",
                   help="compressors (topk is always added as the reference); default: the "
                        f"registered ones of {', '.join(DEFAULT_COMPRESSORS)}")
    p.add_argument("--sizes", action="append", metavar="N[,N...]",
                   help="tensor sizes in elements (260000, 2.6e6, 2.6M); default "
                        + ",".join(map(str, DEFAULT_SIZES)))
    p.add_argument("--ratios", type=floats, default=None,
                   help="ratios for compressors that take one; default "
                        + ",".join(map(str, DEFAULT_RATIOS)))
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per cell after one warm-up (median); "
                        f"default {DEFAULT_REPEATS}")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch.set_num_threads")
    p.add_argument("--device", default="auto",
                   help="auto (cpu, plus cuda when available) or a comma list of cpu, cuda[:N]")
    p.add_argument("--source", default=DEFAULT_SOURCE, help="synthetic distribution of the tensor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds per cell: fewer repeats (reported as capped) beyond it")
    p.add_argument("--decode-workers", type=ints, default=None,
                   help="K for the decoding comparison; default "
                        + ",".join(map(str, DEFAULT_DECODE_WORKERS)))
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few repeats, for smoke tests (explicit flags still win)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    p.set_defaults(func=run)


def run(args) -> int:
    from repro import bench

    quick = args.quick
    sizes = bench.split_list(args.sizes) or (bench.QUICK_SIZES if quick else bench.DEFAULT_SIZES)
    ratios = args.ratios or (bench.QUICK_RATIOS if quick else bench.DEFAULT_RATIOS)
    repeats = args.repeats if args.repeats is not None else (
        bench.QUICK_REPEATS if quick else bench.DEFAULT_REPEATS)
    decode_workers = args.decode_workers or (
        bench.QUICK_DECODE_WORKERS if quick else bench.DEFAULT_DECODE_WORKERS)
    if args.out:
        # Fail on an unwritable path now, not after minutes of timing.
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"--out {args.out!r}: folder {folder!r} does not exist")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"--out {args.out!r}: folder {folder!r} is not writable")
    report = bench.run_bench(
        compressor_names=args.compressor,
        sizes=sizes,
        ratios=ratios,
        repeats=repeats,
        threads=args.threads,
        devices=args.device,
        source=args.source,
        seed=args.seed,
        budget_s=args.budget,
        decode_workers=decode_workers,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    text = json.dumps(report, indent=2)
    if args.out:
        from repro.durable import write_text

        write_text(args.out, text + "\n")
    print(text if args.json else bench.format_report(report))
    return 0
