"""`repro figure ID [ID ...] [--size smoke|full] [OVERRIDES]`: reproduce paper figures.

`repro figure --list` shows every figure with its status and estimated run time on this
machine; `repro figure --readme` regenerates results/README.md from the figures' status
files; `repro figure --default` runs the default set (about 6 minutes on an idle 2-core CPU).
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("figure", help="reproduce a paper figure (run, plot, compare with the paper)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("figures", nargs="*", metavar="ID", help="figure ids, e.g. sidco-fig16 (wildcards allowed)")
    p.add_argument("--size", choices=("smoke", "full"), default="full",
                   help="full: the figure as reproduced here (default); smoke: a tiny CI variant")
    p.add_argument("--out", default=None, help="results root (default: results/ of the clone, or $GRADCOMP_RESULTS)")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for the figure's training runs (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--list", action="store_true", help="list figures with status and estimated run time")
    g.add_argument("--readme", action="store_true", help="regenerate results/README.md")
    g.add_argument("--default", action="store_true", help="run the default set")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from repro import figures
    from repro.figures import base

    figures.load_all()
    root = Path(args.out) if args.out else None
    if args.list:
        print(f"{'figure':<18} {'paper':<8} {'kind':<10} {'est. full':>10} {'est. smoke':>11}  status")
        for fid in figures.registered():
            f = figures.get(fid)
            est = f.est_seconds
            default = "*" if fid in figures.DEFAULT_SET else " "
            print(f"{fid:<18} {f.paper:<8} {f.kind:<10} {est['full'] / 60:>8.1f} m {est['smoke']:>9.0f} s "
                  f"{default}{base.status_line(fid, root)}")
        print("* in the default set (scripts/repro_figure.sh with no argument)")
        return 0
    if args.readme:
        print(f"wrote {base.write_results_readme(root)}")
        return 0
    ids: list[str] = []
    if args.default:
        ids = list(figures.DEFAULT_SET)
    for pattern in args.figures:
        matched = figures.registered(pattern)
        if not matched:
            figures.get(pattern)  # KeyError naming the known figures
        ids += [m for m in matched if m not in ids]
    if not ids:
        raise ValueError("name a figure (e.g. `repro figure sidco-fig16`), or --default, --list, --readme")
    failed = []
    for fid in ids:
        try:
            base.run_figure(fid, size=args.size, out_root=root, overrides=args.override)
        except Exception as exc:  # one broken figure must not stop the rest of the set
            print(f"{fid}: FAILED: {type(exc).__name__}: {exc}")
            failed.append(fid)
    if args.size == "full" and root is None:
        print(f"wrote {base.write_results_readme(root)}")
    return 1 if failed else 0
