"""`repro figure ID [ID ...] [--size smoke|full|long] [--publish] [OVERRIDES]`: reproduce paper figures.

A run writes into outputs/<figure>/ (ignored by git; --out elsewhere) and compares its
rows with the published reference results/<figure>/ (the published value and verdict
beside this run's); only --publish writes results/<figure>/ and results/README.md.
`repro figure --list` shows every figure with its status and estimated run time on this
machine (recorded run times); `repro figure --rules` prints the verdict rules
and the causes a row that does not hold names;
`repro figure --default` runs the default set; `repro figure --extended` the long variants
of the training figures (outputs/long/, published to results/long/).
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("figure", help="reproduce a paper figure (run, plot, compare with the paper)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("figures", nargs="*", metavar="ID", help="figure ids, e.g. sidco-fig16 (wildcards allowed)")
    p.add_argument("--size", choices=("smoke", "full", "long"), default="full",
                   help="full: the figure as reproduced here (default); smoke: a tiny CI variant; "
                        "long: training long enough to judge convergence claims (training "
                        "figures of the extended set only)")
    p.add_argument("--out", default=None,
                   help="outputs root: each figure writes <out>/<figure>/ (default: outputs/ of "
                        "the clone, outputs/smoke/ for --size smoke, or $GRADCOMP_OUTPUTS)")
    p.add_argument("--results", default=None,
                   help="published results root, read for the comparison and written by "
                        "--publish (default: results/ of the clone, or $GRADCOMP_RESULTS)")
    p.add_argument("--publish", action="store_true",
                   help="also publish each finished figure into the results root and regenerate "
                        "its README.md (maintainers; files are written only where they change)")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for the figure's training runs (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--list", action="store_true", help="list figures with status and estimated run time")
    g.add_argument("--readme", action="store_true", help="regenerate the results root's README.md")
    g.add_argument("--rules", action="store_true", help="print the verdict rule table and the causes of rows that do not hold")
    g.add_argument("--default", action="store_true", help="run the default set")
    g.add_argument("--extended", action="store_true",
                   help="run the extended set: every figure with a long variant, at --size long")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from repro import figures
    from repro.figures import base

    figures.load_all()
    out_root = Path(args.out) if args.out else None
    results_root = Path(args.results) if args.results else base.default_results_root()
    if args.rules:
        print(base.rules_markdown())
        print()
        print("A row that does not hold names one cause:")
        print()
        print(base.causes_markdown())
        return 0
    if args.list:
        kind = base.machine()["kind"]
        print(f"estimates: recorded run times of this machine kind ({kind}) where there are any")
        print(f"{'figure':<18} {'paper':<8} {'kind':<10} {'est. full':>10} {'est. smoke':>11} "
              f"{'est. long':>10}  published")
        total_long = 0.0
        total = 0.0
        built_in = []
        listed = [fid for fid in figures.registered()
                  if not args.figures or any(fid in figures.registered(p) for p in args.figures)]
        if not listed:
            raise ValueError(f"no figure matches {' '.join(args.figures)}; the figures: "
                             f"{', '.join(figures.registered())}")
        for fid in listed:
            f = figures.get(fid)
            full, where = base.estimate_seconds(fid, "full", out_root, results_root, kind)
            smoke, _ = base.estimate_seconds(fid, "smoke", out_root, results_root, kind)
            default = "*" if fid in figures.DEFAULT_SET else " "
            if fid in figures.DEFAULT_SET:
                total += full
            mark = "" if "same machine" in where else " (?)"
            long_text = ""
            if "long" in f.est_seconds:
                long_s, long_where = base.estimate_seconds(fid, "long", out_root, results_root,
                                                           kind)
                total_long += long_s
                if long_where == "built-in estimate":
                    built_in.append(fid)
                long_text = f"{long_s:>8.0f} s"
            print(f"{fid:<18} {f.paper:<8} {f.kind:<10} {full:>8.0f} s{mark:<4}{smoke:>5.0f} s "
                  f"{long_text:>10}  {default}{base.status_line(fid, results_root)}")
        if args.figures:
            print("(?) no run recorded on this machine kind: a run elsewhere, or the built-in "
                  "estimate")
            return 0
        print(f"* in the default set (scripts/repro_figure.sh with no argument): about "
              f"{total / 60:.1f} min in all")
        source = (f" (built-in upper estimates for {', '.join(built_in)}: no long run of them "
                  "recorded on this machine kind)" if built_in else "")
        print(f"the extended set (scripts/repro_figure.sh --set extended: the long variants): "
              f"about {total_long / 60:.0f} min in all{source}")
        print("(?) no run recorded on this machine kind: a run elsewhere, or the built-in estimate")
        return 0
    if args.readme:
        print(f"wrote {base.write_results_readme(results_root)}")
        return 0
    size = "long" if args.extended else args.size
    if args.extended and args.size not in ("full", "long"):
        raise ValueError(f"--extended runs the long variants; drop --size {args.size}")
    if args.publish and size == "smoke":
        raise ValueError("--publish writes the published full or long results; drop --size smoke")
    ids: list[str] = []
    if args.default:
        ids = list(figures.DEFAULT_SET)
    if args.extended:
        ids = base.extended_set()
    for pattern in args.figures:
        matched = figures.registered(pattern)
        if not matched:
            figures.get(pattern)  # KeyError naming the known figures
        ids += [m for m in matched if m not in ids]
    if not ids:
        raise ValueError("name a figure (e.g. `repro figure sidco-fig16`), or --default, "
                         "--extended, --list, --readme, --rules")
    failed = base.run_figures(ids, size=size, out_root=out_root, overrides=args.override,
                              results_root=results_root,
                              publish_to=results_root if args.publish else None)
    if args.publish:
        print(f"wrote {base.write_results_readme(results_root)}")
    return 1 if failed else 0
