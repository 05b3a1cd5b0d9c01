"""`repro train [OVERRIDES...] [-m] [--restart]`: compose, validate, launch (see
repro/launch.py; a run whose directory holds a different config is refused unless
--restart)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a task with a compressor (Hydra overrides; -m sweeps comma lists)",
        description="Examples: repro train compressor=topk compressor.ratio=0.01 task=cifar10_resnet20 "
        "| repro train -m compressor=topk,dgc compressor.ratio=0.01,0.001 cluster=simulated",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. compressor=dgc steps=200")
    p.add_argument("-m", "--multirun", action="store_true", help="expand comma lists into a sweep")
    p.add_argument("--dry-run", action="store_true", help="compose and validate only")
    p.add_argument("--restart", action="store_true",
                   help="delete the runs' existing directories (config, metrics, checkpoints) "
                   "and run afresh; without it a finished run is skipped, an unfinished one "
                   "resumes, and a run whose directory holds a different config is refused")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run)


def run(args) -> int:
    from omegaconf import OmegaConf

    from repro import launch

    if args.print_config:
        cfg = launch.compose(args.overrides)
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return 0
    launch.train(args.overrides, multirun=args.multirun, dry_run=args.dry_run, restart=args.restart)
    return 0
