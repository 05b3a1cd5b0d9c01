"""`repro configs --check | --write`: keep conf/compressor and conf/task in sync with the
registries. conf/compressor is generated; conf/task is written by hand (the tasks'
hyper-parameters) and only checked."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("configs", help="check conf/compressor and conf/task against the registries; "
                                       "regenerate conf/compressor")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true",
                   help="exit 1 if conf/ differs from the registries: a compressor file stale or "
                        "missing, a task file missing, misnamed, or with a hyper-parameter the "
                        "task does not accept or out of range (default)")
    g.add_argument("--write", action="store_true",
                   help="(re)write the generated conf/compressor files; conf/task files are "
                        "written by hand, and their problems are listed")
    p.set_defaults(func=run)


def run(args) -> int:
    from repro import confgen
    from repro.config import conf_dir

    conf = conf_dir()
    if args.write:
        for path in confgen.write(conf):
            print(f"wrote {path}")
        for problem in confgen.task_problems(conf):
            print(f"not written (edit by hand): {problem}")
        return 0
    problems = confgen.check(conf)
    for p in problems:
        print(p)
    if problems:
        print("run `repro configs --write` to regenerate conf/compressor; fix conf/task files by hand")
    return 1 if problems else 0
