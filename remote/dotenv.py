"""`fab run --env-file FILE`: variables in dotenv syntax, read here; no value is ever put in a message.

    # a comment                 KEY=plain value   # a comment after a space
    export KEY=value            KEY='single: taken as written, $HOME and \\n too'
    KEY = value                 KEY="double: \\n \\t \\" \\\\ are escapes; may span lines"

Nothing is expanded (`$VAR`, `${VAR}` arrive as written), as with `--env`. The names are checked by
`remote/options.py` as `--env`'s are.
"""

import re
from dataclasses import dataclass

ASSIGNMENT = re.compile(r"(?:export[ \t]+)?([^=\s]*)[ \t]*=[ \t]*")
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}


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
    lines = text.splitlines()
    found: list[Variable] = []
    index = 0
    while index < len(lines):
        number, line = index + 1, lines[index].strip()
        index += 1
        if not line or line.startswith("#"):
            continue
        match = ASSIGNMENT.match(line)
        if not match:
            raise DotenvError(f"line {number} is not KEY=VALUE")
        rest = line[match.end() :]
        if rest[:1] in ("'", '"'):
            value, index = _quoted(rest, lines, index, number)
        else:
            value = re.split(r"[ \t]#", rest, maxsplit=1)[0].rstrip()
        found.append(Variable(match.group(1), value, number))
    return found


def _quoted(rest: str, lines: list[str], index: int, number: int) -> tuple[str, int]:
    """The value of a quoted assignment (which may go on over the next lines) and the next line's index."""
    quote, text = rest[0], rest[1:]
    while True:
        end = _closing(text, quote)
        if end is not None:
            break
        if index >= len(lines):
            raise DotenvError(f"line {number}: the value opens a {quote} quote that is never closed")
        text += "\n" + lines[index]
        index += 1
    after = text[end + 1 :].strip()
    if after and not after.startswith("#"):
        raise DotenvError(f"line {number}: text after the closing {quote} quote (quote the whole value)")
    value = text[:end]
    return (_unescape(value) if quote == '"' else value), index


def _closing(text: str, quote: str) -> int | None:
    """Where the closing quote is; inside double quotes a backslash escapes the next character."""
    position = 0
    while position < len(text):
        if quote == '"' and text[position] == "\\":
            position += 2
            continue
        if text[position] == quote:
            return position
        position += 1
    return None


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), value, flags=re.DOTALL)
