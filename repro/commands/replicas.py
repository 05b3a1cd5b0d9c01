"""`repro replicas`: do n gloo ranks training through the public hook end with identical
models? One line per sparse compressor (repro.replicacheck)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from repro import replicacheck

    p = sub.add_parser(
        "replicas",
        help="check that ranks training through the hook hold bit-identical models",
        description="Example (one GPU shared by 4 gloo ranks): repro replicas --device cuda "
                    "--workers 4 --steps 40 --params 16800000",
    )
    replicacheck.add_arguments(p)
    p.set_defaults(func=replicacheck.run)
