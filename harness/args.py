"""Command-line checks the examples share: a bad value is one line `error: ...` and exit 2.

argparse's own failure prints the usage and then the error; a person launching on several nodes
reads that once per rank. `ExampleParser` keeps it to the one line, and the `type=` helpers refuse
values that would only fail later (a `--log-every 0` that divides by zero at the first step).
"""

import argparse


class ExampleParser(argparse.ArgumentParser):
    """argparse with the project's error contract: one line on stderr, exit 2, before anything runs."""

    def __init__(self, doc: str | None, **kwargs):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def _number(text: str, kind: type, lowest: float, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}") from None
    if not value >= lowest:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count: a whole number of at least 1 (steps, sizes, log intervals)."""
    return _number(text, int, 1, "a whole number of at least 1")


def non_negative_int(text: str) -> int:
    """A whole number of at least 0 (warm-up steps, seeds, a start iteration)."""
    return _number(text, int, 0, "a whole number of at least 0")


def positive_float(text: str) -> float:
    """A quantity above 0 (a learning rate, a timeout in seconds, a tolerance)."""
    value = _number(text, float, 0, "a number above 0")
    if value == 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {text!r}")
    return value
