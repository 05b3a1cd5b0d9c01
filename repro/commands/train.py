"""`repro train [OVERRIDES...] [-m] [--restart] [--wait]`: compose, validate, launch (see
repro/launch.py; a run whose directory holds a different config is refused unless
--restart).

How it ends: 0 when every run finished; 2 with one line for bad input; 1 with one line
naming the cause and the log holding the traceback (repro.failures) when a run failed;
128 + the signal's number after a SIGTERM / SIGINT, with the line saying where the run
stopped and that the same command resumes (repro.stopping)."""

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
                   "resumes, and a run whose directory holds a different config is refused. "
                   "Only folders repro train made are deleted, each one named; with --dry-run "
                   "it lists them")
    p.add_argument("--wait", action="store_true",
                   help="when another launch is running a run of this command, wait for it "
                   "(without it the command stops, naming that process)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run)


AT_ONCE = ("interrupted at once (before a run could stop at a step, or by a second "
           "signal); every file written is whole and the same command goes on from the last "
           "checkpoint")


def run(args) -> int:
    from omegaconf import OmegaConf

    from repro import launch

    if args.print_config:
        cfg = launch.compose(args.overrides)
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return 0
    import signal
    import sys
    import time

    from repro import failures, runfolder, stopping

    started = time.time()
    try:
        launch.train(args.overrides, multirun=args.multirun, dry_run=args.dry_run,
                     restart=args.restart, wait=args.wait)
    except stopping.Interrupted as exc:
        print(f"repro train: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except runfolder.RunInUse as exc:
        print(f"repro train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a run took it, or a second one
        print(f"repro train: {AT_ONCE}", file=sys.stderr)
        return 128 + signal.SIGINT
    except (ValueError, TypeError, KeyError, FileNotFoundError, FloatingPointError):
        raise  # bad input: repro.cli prints it as one line
    except Exception as exc:  # noqa: BLE001 - a failed run ends as one line and a log entry
        run_dir = getattr(exc, "run_dir", None)
        log = failures.record_exception(run_dir, "launcher", exc)
        print(failures.failure_line("repro train", exc, log, run_dir, started), file=sys.stderr)
        return 1
    return 0
