"""`repro measure`: estimation quality, actual density, NMSE, error-feedback norm, bytes
and encode/decode time of compressors on simulated workers (library: repro.measure)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    from repro.cli import DefaultsFormatter
    from repro.measure import (
        DEFAULT_COMPRESSORS,
        DEFAULT_RATIO,
        DEFAULT_SIZE,
        DEFAULT_SOURCE,
        DEFAULT_STEPS,
        DEFAULT_WORKERS,
        FEEDBACKS,
    )

    p = sub.add_parser(
        "measure",
        help="compare compressors on simulated workers: k̂/k, density, NMSE, EF norm, bytes, time",
        description=(
            "Run compressors (each with its error feedback) for several steps over n "
            "simulated workers on the same synthetic or saved gradients, and report "
            "estimation quality k̂/k, actual density of the aggregate, NMSE against the exact "
            "mean, relative error-feedback norm, bytes per worker and encode/decode time. "
            "Example (THC Fig. 2b): repro measure --compressor topk,terngrad,thc --ratio 0.1 "
            "--workers 2 --source lognormal"
        ),
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--compressor", action="append", metavar="NAME[,NAME...]",
                   help="compressor(s) to compare, repeatable or comma-separated "
                        f"(default: the registered ones of {', '.join(DEFAULT_COMPRESSORS)})")
    p.add_argument("--ratio", type=float, default=DEFAULT_RATIO,
                   help="fraction of elements kept, for compressors that take a ratio")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="simulated workers n")
    p.add_argument("--size", type=int, default=DEFAULT_SIZE,
                   help="gradient elements d (ignored for file: sources)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps S")
    p.add_argument("--source", default=DEFAULT_SOURCE,
                   help="laplace, normal, lognormal, gamma, student-t, or file:PATH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zeros", type=float, default=0.0, metavar="FRACTION",
                   help="fraction F (0 ≤ F < 1) of a synthetic source's coordinates that are "
                        "exact zeros in every worker's gradient at every step, at positions "
                        "drawn once from --seed (like embedding rows no batch touches)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="compressor parameter (repeatable); goes to every selected compressor "
                        "that accepts it; values parse as int/float/true/false/none/str")
    p.add_argument("--feedback", default="default", choices=FEEDBACKS,
                   help="error feedback; 'default' is each compressor's own")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    from repro.measure import format_table, measure, parse_params

    results = measure(
        compressor_names=args.compressor,
        ratio=args.ratio,
        workers=args.workers,
        size=args.size,
        steps=args.steps,
        source=args.source,
        seed=args.seed,
        params=parse_params(args.param),
        feedback=args.feedback,
        device=args.device,
        zeros=args.zeros,
    )
    if args.json:
        print(json.dumps({"results": results}, indent=2))
    else:
        print(format_table(results))
    return 0
