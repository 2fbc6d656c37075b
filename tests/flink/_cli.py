"""`python tests/flink/_cli.py flink run ...`: the `ratchet flink` command group on its own
(so the tests do not depend on it being wired into `ratchet.cli`)."""

import argparse
import sys

from ratchet.cli import _flink

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="ratchet")
    _flink.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    sys.exit(args.func(args))
