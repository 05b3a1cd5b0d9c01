"""`repro compare RUN_DIRS... [--out DIR] [--x step|time] [--metric NAME]...`: side-by-side
table, plots and an HTML page for training runs (library: repro.compare)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="compare training runs: table of loss/quality/throughput/k̂/k/density, PNG plots, HTML",
        description=(
            "Read each run directory's config.yaml, metrics.jsonl and summary.json, print one "
            "table row per run (final loss, best quality metric, time to target, throughput, "
            "estimation quality k̂/k, actual density, bytes per worker, compress/comm time) and "
            "write PNG plots, table.csv and index.html to --out (default: runs/<group>/compare/"
            "<time>/ beside the runs). Runs of one config over several seeds get a mean ± std "
            "row; runs that differ in workers or launch mode, a warning. Loss and the quality "
            "metric are plotted against both step and wall time; --x picks the x-axis of the "
            "per-step diagnostics. Example: repro compare runs/default/* --out cmp"
        ),
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (runs/<group>/<name>)")
    p.add_argument("--out", default=None,
                   help="output folder for the plots and index.html (default: "
                        "compare/<timestamp>/ in the runs' group folder, runs/<group>/)")
    p.add_argument("--x", choices=("step", "time"), default="step",
                   help="x-axis of the throughput, k̂/k, density and bytes plots")
    p.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="one more metric to tabulate (mean and last value) and plot against "
                        "--x; a metrics.jsonl key or its W&B name, e.g. estimation_quality or "
                        "compress/khat_over_k (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from repro.compare import compare

    compare(args.runs, out=args.out, x=args.x, metrics=args.metric)
    return 0
