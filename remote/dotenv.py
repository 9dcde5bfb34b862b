"""`fab run --env-file FILE`: variables in dotenv syntax, read by python-dotenv's parser (the one
`dotenv_values` uses), with nothing interpolated; no value is ever put in a message.

    # a comment                 KEY=plain value   # a comment after a space
    export KEY=value            KEY='single: taken as written, $HOME and \\n too'
    KEY = value                 KEY="double: \\n \\t \\" \\\\ are escapes; may span lines"

`dotenv_values(path, interpolate=False)` is this parser's bindings as a dict: it skips a line it cannot
read with a warning, takes a name given twice silently (the last wins) and gives `KEY` alone the value
None. Here each of those is refused, naming the line, so this module reads the bindings themselves
(`dotenv.parser.parse_stream`). The names, reserved variables, NUL bytes and the file's size are
checked by `remote/options.py`, as `--env`'s are.
"""

import io
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One assignment of the file."""

    key: str
    """The name as written (checked by the caller)."""
    value: str
    """The value, quotes removed."""
    line: int
    """The line it starts on, counted from 1."""


class DotenvError(ValueError):
    """A line that is not an assignment; the message names the line, never a value."""


def parse(text: str) -> list[Variable]:
    """Every assignment of `text`, in order."""
    from dotenv.parser import parse_stream  # loads for an --env-file only, not at every fab start (issue 41)

    found: list[Variable] = []
    for binding in parse_stream(io.StringIO(text)):
        original = binding.original.string
        # A binding's text starts with the blank lines before it; its line is the first of them.
        line = binding.original.line + original[: len(original) - len(original.lstrip())].count("\n")
        if binding.error:
            raise DotenvError(f"line {line} is not KEY=VALUE (a quote never closed, or text after the closing one)")
        if binding.key is None:  # a comment or blank lines
            continue
        if binding.value is None:
            raise DotenvError(f"line {line} is not KEY=VALUE (a name without '=')")
        found.append(Variable(binding.key, binding.value, line))
    return found
