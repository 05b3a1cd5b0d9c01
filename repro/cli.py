"""`repro`: the suite's command line. Each subcommand lives in repro/commands/<name>.py
and exposes `add_parser(subparsers)` (which sets `func` on its parser); modules are
found automatically, so adding a command touches no central table."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import repro.commands


class DefaultsFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help where it has a default that means something
    (not None, not False) and its help does not already say its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="repro",
        description="gradcomp-repro: gradient compressors for DDP and their papers' figures.",
    )
    from repro.commands.train import version_text

    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(repro.commands.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"repro.commands.{mod.name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, KeyError, FileNotFoundError, FloatingPointError) as exc:
        # Bad input is reported as one clear line, not a traceback.
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"repro {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
