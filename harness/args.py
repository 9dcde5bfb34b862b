"""The command line the examples share: its error contract, its value checks and its common flags.

A bad value is one line `error: ...` and exit 2. argparse's own failure prints the usage and then the
error; a person launching on several nodes reads that once per rank. `ExampleParser` keeps it to the
one line, and the `type=` helpers refuse values that would only fail later (a `--log-every 0` that
divides by zero at the first step).

The flags several examples take (`--steps`, `--batch-size`, `--lr`, `--log-every`, `--seed`, `--check`,
`--timeout`, `--json`, `--plot`) are declared here once: name, type and the shape of the help, which
ends with the default. An example passes only what is its own: the default and what the number counts.
"""

import argparse
from pathlib import Path


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


# ------------------------------------------------------------------------------------ common flags


def _shown(value: float) -> str:
    """A default as a help text writes it: 300, 0.05, 3e-3 (not 0.003)."""
    return f"{value:.0e}".replace("e-0", "e-") if 0 < abs(value) < 0.01 else f"{value:g}"


def add_training_arguments(
    parser: argparse.ArgumentParser,
    *,
    steps: int,
    steps_help: str = "optimizer steps",
    batch_size: int | None = None,
    batch_help: str = "",
    lr: float | None = None,
    lr_help: str = "AdamW learning rate",
) -> None:
    """`--steps`, then `--batch-size` and `--lr` where the example takes them (`batch_help` says what a
    batch holds and where it goes: per rank, or split over the ranks)."""
    parser.add_argument("--steps", type=positive_int, default=steps, help=f"{steps_help} (default {steps})")
    if batch_size is not None:
        parser.add_argument(
            "--batch-size", type=positive_int, default=batch_size, help=f"{batch_help} (default {batch_size})"
        )
    if lr is not None:
        parser.add_argument("--lr", type=positive_float, default=lr, help=f"{lr_help} (default {_shown(lr)})")


def add_run_arguments(
    parser: argparse.ArgumentParser,
    *,
    log_every: int | None = None,
    log_help: str = "print a step line every N steps",
    seed: bool = True,
    check: str | None = None,
    timeout_s: float = 300,
) -> None:
    """The flags that close an example's list: `--log-every` where it prints step lines, `--seed` where
    it draws weights or data, `--check` (`check` is its help: what it compares; it prints one line and
    exits 0 or 1), and `--timeout` for the rendezvous and every collective."""
    if log_every is not None:
        parser.add_argument(
            "--log-every",
            type=positive_int,
            default=log_every,
            help=f"{log_help} (default {log_every})",
        )
    if seed:
        parser.add_argument("--seed", type=non_negative_int, default=0, help="model and data seed (default 0)")
    if check is not None:
        parser.add_argument("--check", action="store_true", help=check)
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=timeout_s,
        help=f"seconds to wait for all ranks (default {_shown(timeout_s)})",
    )


def add_results_arguments(
    parser: argparse.ArgumentParser, *, json_name: str, plot_what: str, plot_name: str | None = None
) -> None:
    """`--json`, written as `json_name` in the results folder unless given (harness.results), and `--plot`,
    a PNG of `plot_what`: written only where asked, unless `plot_name` names the one it always writes."""
    parser.add_argument(
        "--json", type=Path, default=None, help=f"write results here (default {json_name} in the results folder)"
    )
    where = f" (default {plot_name} in the results folder)" if plot_name else ""
    parser.add_argument("--plot", type=Path, default=None, help=f"write a PNG of {plot_what} here{where}")
