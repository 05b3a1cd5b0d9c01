"""`repro configs --check | --write`: keep conf/compressor and conf/task in sync with
the registries."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("configs", help="check or regenerate conf/compressor and conf/task from the registries")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="exit 1 if conf/ differs from the registries (default)")
    g.add_argument("--write", action="store_true", help="(re)write the generated files")
    p.set_defaults(func=run)


def run(args) -> int:
    from repro import confgen
    from repro.launch import conf_dir

    conf = conf_dir()
    if args.write:
        for path in confgen.write(conf):
            print(f"wrote {path}")
        return 0
    problems = confgen.check(conf)
    for p in problems:
        print(p)
    if problems:
        print("run `repro configs --write` to regenerate")
    return 1 if problems else 0
