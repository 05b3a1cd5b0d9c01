"""`repro train [OVERRIDES...] [-m] [--restart] [--retry-failed] [--wait] [--dry-run]
[--cfg job|hydra|all] [--info] [--version]`: compose, validate, launch (see repro/launch.py;
a run whose directory holds a different config is refused unless --restart).

How it ends: 0 when every run finished; 2 with one line for bad input; 1 with one line
naming the cause and the log holding the traceback (repro.failures) when a run failed (a
sweep first runs the rest and lists its failures);
128 + the signal's number after a SIGTERM / SIGINT, with the line saying where the run
stopped and that the same command resumes (repro.stopping)."""

from __future__ import annotations


def groups_epilog() -> str:
    """The config groups and their options, for `repro train --help`."""
    import textwrap

    from repro import launch

    try:
        lines = [textwrap.fill(f"{g}: {', '.join(launch.group_options(g))}", width=88,
                               initial_indent="  ", subsequent_indent="      ",
                               break_on_hyphens=False)
                 for g in launch.CONFIG_GROUPS]
    except FileNotFoundError as exc:
        return f"config groups: {exc}"
    return ("config groups (GROUP=OPTION; -m GROUP=a,b or GROUP='glob(pattern)' sweeps them):\n"
            + "\n".join(lines) + "\nevery key with its default: repro train --cfg job")


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser(
        "train",
        help="train a task with a compressor (Hydra overrides; -m sweeps comma lists)",
        description="Examples: repro train compressor=topk compressor.ratio=0.01 task=cifar10_resnet20 "
        "| repro train -m compressor=topk,dgc compressor.ratio=0.01,0.001 cluster=simulated",
        epilog=groups_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. compressor=dgc steps=200")
    p.add_argument("-m", "--multirun", action="store_true", help="expand comma lists into a sweep")
    p.add_argument("--dry-run", action="store_true",
                   help="compose and validate only; with a submitit launcher, print each job's "
                   "sbatch settings")
    p.add_argument("--restart", action="store_true",
                   help="delete the runs' existing directories (config, metrics, checkpoints) "
                   "and run afresh; without it a finished run is skipped, an unfinished one "
                   "resumes, and a run whose directory holds a different config is refused. "
                   "Only folders repro train made are deleted, each one named; with --dry-run "
                   "it lists them")
    p.add_argument("--retry-failed", action="store_true",
                   help="run again the runs of a sweep whose last attempt failed or diverged "
                   "(without it a sweep skips them, naming the reason)")
    p.add_argument("--wait", action="store_true",
                   help="when another launch is running a run of this command, wait for it "
                   "(without it the command stops, naming that process)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit (as --cfg job)")
    p.add_argument("--cfg", choices=("job", "hydra", "all"), default=None,
                   help="print the resolved config (job), Hydra's own (hydra) or both, and exit")
    p.add_argument("--info", action="store_true",
                   help="print the versions, the config search path, the config groups with "
                   "their options and this run's choices, and exit")
    p.add_argument("--version", action="version", version=version_text())
    p.set_defaults(func=run)


def version_text() -> str:
    from repro.provenance import DISTRIBUTION, version

    return (f"{DISTRIBUTION} {version(DISTRIBUTION) or 'unknown'} (Hydra "
            f"{version('hydra-core') or 'missing'}, torch {version('torch') or 'missing'})")


def print_cfg(which: str, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from repro import cluster, launch

    run_overrides, _ = cluster.split_overrides(launch.prepare_overrides(overrides))
    if which in ("job", "all"):
        print(OmegaConf.to_yaml(launch.compose(run_overrides), resolve=True), end="")
    if which in ("hydra", "all"):
        print(OmegaConf.to_yaml(launch.hydra_config(overrides)), end="")


def print_info(overrides: list[str]) -> None:
    from repro import cluster, launch
    from repro import config as config_mod

    run_overrides, _ = cluster.split_overrides(launch.prepare_overrides(overrides))
    launch.compose(run_overrides)  # the same checks as a run's
    hydra = launch.hydra_config(overrides).hydra
    print(version_text())
    print(f"config search path: {config_mod.conf_dir()} (GRADCOMP_CONF overrides it); schema: "
          "repro.config.TrainConfig")
    print("config groups:")
    for group in launch.CONFIG_GROUPS:
        print(f"  {group}: {', '.join(launch.group_options(group))}")
    choices = {k: v for k, v in hydra.runtime.choices.items() if not k.startswith("hydra")}
    print("this run's choices: " + ", ".join(f"{k}={v}" for k, v in choices.items()))
    print("overrides: " + (" ".join(overrides) or "(none)"))


AT_ONCE = ("interrupted at once (before a run could stop at a step, or by a second "
           "signal); every file written is whole and the same command goes on from the last "
           "checkpoint")


def run(args) -> int:
    from repro import launch

    if args.print_config or args.cfg:
        print_cfg(args.cfg or "job", args.overrides)
        return 0
    if args.info:
        print_info(args.overrides)
        return 0
    import signal
    import sys
    import time

    from repro import failures, runfolder, stopping

    started = time.time()
    try:
        launch.train(args.overrides, multirun=args.multirun, dry_run=args.dry_run,
                     restart=args.restart, wait=args.wait, keep_going=args.multirun,
                     retry_failed=args.retry_failed or not args.multirun,
                     progress=args.multirun)
    except launch.RunsFailed as exc:
        print(f"repro train: {exc}", file=sys.stderr)
        return 1
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
