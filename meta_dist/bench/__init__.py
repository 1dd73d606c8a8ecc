"""The benchmarks, behind one entry point: ``mpirun -np N python -m meta_dist bench NAME ...``.

    collectives   time and bus bandwidth of each collective beside the raw library call
    fusion        200 small arrays allreduced as one fused list beside one raw call each
    train         the reference MLP or a GPT at ZeRO levels 0-3, beside PyTorch (--torch)
    checkpoint    save and resume time and bytes per rank, beside plain np.save

``python -m meta_dist bench NAME --help`` gives each one's options. Benchmarks print numbers;
tests never time anything (tests/test_bench.py runs each one briefly for its exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, NoReturn

from meta_dist.errors import UsageError

NAMES = ("collectives", "fusion", "train", "checkpoint")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are a UsageError: one line for the job, exit 2.

    argparse's own ``error`` printed the usage and exited on every rank, and failfast took
    each exit for a rank ending early: a usage per rank, then MPI_Abort's banner. A UsageError
    is printed once, by the lowest rank (``meta_dist.failfast``).
    """

    def error(self, message: str) -> NoReturn:
        """Raise UsageError naming the benchmark and ``message`` (argparse's words).

        A script's own parser (ping_pong.py) leaves its name out: failfast's line starts with it.
        """
        command = self.prog.removeprefix("python -m meta_dist ")
        where = f"{command}: " if command != self.prog else ""
        raise UsageError(f"{where}{message}; --help lists the options")


def check_counts(parser: Any, args: Any, least: dict[str, int]) -> None:
    """Refuse, with ``parser.error`` (a UsageError), an option below its least value.

    ``least`` maps an option (``--steps``) to the smallest value it takes; None (not given)
    passes. A 0 or a negative count made a table of nan, a ZeroDivisionError, or (--min-bytes)
    an endless loop.
    """
    for option, low in least.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None and value < low:
            parser.error(f"{option}: got {value}; expected a number >= {low}")


def check_order(parser: Any, args: Any, low: str, high: str) -> None:
    """Refuse (``parser.error``) a ``high`` option below the ``low`` one (--max-bytes, say)."""
    below, above = (getattr(args, o.lstrip("-").replace("-", "_")) for o in (low, high))
    if above < below:
        parser.error(f"{high}: got {above}; expected a number >= {low} ({below})")


def main(argv: list[str]) -> int:
    """Run the benchmark ``argv[0]`` names with the options after it."""
    if not argv or argv[0] not in NAMES:
        usage = (f"usage: python -m meta_dist bench {{{'|'.join(NAMES)}}} [options] (--help "
                 "after a name lists its options)")
        if argv[:1] in (["-h"], ["--help"]):
            print(usage, file=sys.stderr)
            return 0
        said = f"unknown benchmark {argv[0]!r}" if argv else "which benchmark?"
        raise UsageError(f"bench: {said}; {usage}")  # one line for the job (failfast)
    return importlib.import_module(f"meta_dist.bench.{argv[0]}").main(argv[1:])
