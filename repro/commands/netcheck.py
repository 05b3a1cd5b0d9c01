"""`repro netcheck`: collectives measured on an emulated network of known speed (one
network namespace per gloo rank, links shaped with tc) beside the cost model's time.
Needs root and iproute2 (repro.netem); says in one line what is missing otherwise."""

from __future__ import annotations

import shlex
import sys


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma list of numbers (example: 1,2.5,10)") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma list of integers (example: 2,3,4)") from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "netcheck",
        help="time allreduce/allgather/broadcast on an emulated link vs the cost model",
        description="Example: repro netcheck --workers 2 --bandwidth-gbps 1 --sizes 32M "
                    "--json out.json. Sizes count fp32 elements (32M = 128 MB).",
    )
    p.add_argument("--workers", default="2,3,4", help="comma list of rank counts (default: %(default)s)")
    p.add_argument("--bandwidth-gbps", default="1,2.5,10",
                   help="comma list of link rates in Gbit/s (default: %(default)s)")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="one-way delay added to each uplink, needs the netem qdisc (default: %(default)s)")
    p.add_argument("--sizes", default="250K,2M,8M,32M,64M",
                   help="comma list of fp32 element counts, 1 MB to 256 MB (default: %(default)s)")
    p.add_argument("--ops", default="allreduce,allgather,allgather_unequal,broadcast",
                   help="collectives to time (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per cell (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per cell (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write every cell (measured and projected) to FILE")
    p.add_argument("--markdown", metavar="FILE",
                   help="write the ratios as Markdown tables, one per collective, to FILE")
    p.set_defaults(func=run)


def run(args) -> int:
    from repro import netcheck
    from repro.bench import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    cells = netcheck.run(_ints(args.workers), _floats(args.bandwidth_gbps), sizes, ops,
                         repeats=args.repeats, warmup=args.warmup, latency_ms=args.latency_ms,
                         out=lambda s: print(s, file=sys.stderr, flush=True))
    for line in netcheck.table(cells):
        print(line)
    print(netcheck.summary_line(cells))
    command = " ".join(["repro netcheck", "--workers", args.workers, "--bandwidth-gbps",
                        args.bandwidth_gbps, "--latency-ms", f"{args.latency_ms:g}",
                        "--sizes", args.sizes, "--ops", args.ops, "--repeats",
                        str(args.repeats), "--warmup", str(args.warmup)]
                       + [f"--{k} {shlex.quote(v)}" for k, v in
                          (("json", args.json), ("markdown", args.markdown)) if v])
    if args.json:
        netcheck.write_json(args.json, netcheck.report(cells, command))
        print(f"wrote {args.json}")
    if args.markdown:
        from repro.durable import write_text

        write_text(args.markdown, netcheck.markdown(cells, command) + "\n")
        print(f"wrote {args.markdown}")
    return 0
