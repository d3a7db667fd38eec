"""The benchmarks' ``--quick`` flag, read one way: the quick sizes become the defaults, and a
flag given on the command line still wins."""

import argparse


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None,
               quick: dict) -> argparse.Namespace:
  """``parser``'s arguments in ``argv`` (the command line's where None); with ``--quick``
  (which ``parser`` must declare), ``quick``'s values as the defaults."""
  args = parser.parse_args(argv)
  if args.quick:
    parser.set_defaults(**quick)
    args = parser.parse_args(argv)
  return args
