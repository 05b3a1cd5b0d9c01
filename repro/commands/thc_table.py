"""`repro thc-table`: solve THC's optimal lookup table (Appendix B) and optionally store it.

    repro thc-table --bits 4 --granularity 30 --p 1/32
    repro thc-table --bits 3 --granularity 16 --p 1/32 --symmetric --method enumerate --json
    repro thc-table --bits 4 --granularity 20 --p 1/512 --write
    repro thc-table --standard --write      # every table compressors/data ships
"""

from __future__ import annotations

import argparse
import json

from compressors import thc_table


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "thc-table",
        help="solve THC's optimal lookup table T_{b,g,p} (exact) and print or store it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bits", type=int, help="bit budget b per coordinate (paper: 4)")
    parser.add_argument("--granularity", type=int, help="granularity g ≥ 2^b − 1 (paper: 30)")
    parser.add_argument("--p", default="1/32",
                        help="clamped fraction p, a number or a fraction (default 1/32)")
    parser.add_argument("--symmetric", action="store_true",
                        help="search mirror-symmetric tables only (the authors' restriction)")
    parser.add_argument("--method", choices=("dp", "enumerate"), default="dp",
                        help="dp: exact shortest path (default); "
                             "enumerate: the paper's stars-and-bars scan")
    parser.add_argument("--json", action="store_true", help="print one JSON object per table")
    parser.add_argument("--write", action="store_true",
                        help=f"insert/replace the table(s) in {thc_table.TABLES_FILE}")
    parser.add_argument("--standard", action="store_true",
                        help="solve every configuration the package ships (bits 2-4, g up to 51, "
                             "p in 1/32, 1/64, 1/512, 1/1024) instead of one")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.standard:
        configs = thc_table.standard_configs()
    else:
        if args.bits is None or args.granularity is None:
            raise ValueError("give --bits and --granularity (or --standard)")
        configs = [(args.bits, args.granularity, thc_table.parse_p(args.p))]
    if args.write and args.symmetric:
        raise ValueError("--write stores the unconstrained optimum only; drop --symmetric")
    solved = [
        thc_table.solve(b, g, p, symmetric=args.symmetric, method=args.method)
        for b, g, p in configs
    ]
    for s in solved:
        if args.json:
            record = s.record()
            record.update(method=s.method, candidates=s.candidates, seconds=s.seconds)
            print(json.dumps(record))
        elif not args.standard:
            space = "mirror-symmetric tables" if s.symmetric else "monotone tables"
            print(f"THC table b={s.bits} g={s.granularity} p={s.p:g} (t_p = {s.t_p:.4f})")
            print(f"  table    : {', '.join(map(str, s.table))}")
            print(f"  variance : {s.variance:.10g}  (N(0,1) truncated to [-t_p, t_p])")
            took = f"{s.seconds * 1e3:.1f} ms"
            print(f"  searched : {s.candidates:,} {space} by {s.method} in {took}")
    if args.write:
        total = thc_table.write_tables(solved)
        print(f"wrote {len(solved)} table(s) to {thc_table.TABLES_FILE} ({total} stored)")
    elif args.standard and not args.json:
        took = sum(s.seconds for s in solved)
        print(f"solved {len(solved)} tables in {took:.2f} s (add --write to store)")
    return 0
