"""Tables for the examples: rich when the node has it, plain fixed-width columns when it does not."""


def render_table(title: str, columns: list[str], rows: list[list[str]]) -> str:
    """The table as text, numbers right-aligned (every column but the first)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return _plain(title, columns, rows)
    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(width=200, highlight=False, color_system=None)  # logs are files: no colour codes
    with console.capture() as captured:
        console.print(table)
    return captured.get().rstrip("\n")


def _plain(title: str, columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        """The first cell left-aligned (a name), the others right-aligned (figures)."""
        return "  ".join(
            f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}" for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([title, line(columns), *map(line, rows)])
