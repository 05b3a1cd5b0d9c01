"""Subcommands of `repro`, one module each (see repro/cli.py)."""
