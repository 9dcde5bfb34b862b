"""Remote output, streamed live with a `[node-i]` prefix and kept whole in each node's log file."""

import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from infra import state

if TYPE_CHECKING:  # rich loads only where a table is printed
    from rich.console import Console

COLORS = ("36", "35", "33", "32", "34", "31")  # cyan, magenta, yellow, green, blue, red
_print_lock = threading.Lock()


class NodeStream:
    """A file-like sink for one node's output: complete lines go to the terminal and to the log."""

    def __init__(self, name: str, index: int, log_path: Path | None, echo: bool = True):
        self.prefix = f"[{name}] "
        if sys.stdout.isatty():
            self.prefix = f"\033[{COLORS[index % len(COLORS)]}m[{name}]\033[0m "
        self.echo = echo
        self.log = state.open_private(log_path, "a", buffering=1) if log_path else None
        self.partial = ""
        self.tail: list[str] = []

    def write(self, text: str) -> int:
        self.partial += text
        *lines, self.partial = self.partial.split("\n")
        for line in lines:
            self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        line = line.rstrip("\r")
        self.tail = (self.tail + [line])[-40:]
        if self.log:
            self.log.write(line + "\n")
        if self.echo:
            with _print_lock:
                sys.stdout.write(self.prefix + line + "\n")
                sys.stdout.flush()

    def flush(self) -> None:
        if self.log:
            self.log.flush()

    def close(self) -> None:
        if self.partial:
            self._emit(self.partial)
            self.partial = ""
        if self.log:
            self.log.close()
            self.log = None


def console() -> "Console":
    """rich output for tables: the terminal's width, or a wide page when piped (logs, CI)."""
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def say(message: str) -> None:
    """A line of `fab`'s own, kept apart from node output."""
    with _print_lock:
        sys.stdout.write(message + "\n")
        sys.stdout.flush()
