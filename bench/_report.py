"""Tables a benchmark prints: rich tables on a terminal, or Markdown for ``RESULTS.md``."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

__all__ = ["Report", "print_report"]


@dataclass
class Report:
    """Tables to print, each ``(title, header, rows)`` with cells as text, and notes under them."""

    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def print_report(report: Report, markdown: bool, console: Console) -> None:
    """Print ``report`` as rich tables on ``console``, or as Markdown tables on stdout (notes
    as a list)."""
    for title, header, rows in report.tables:
        if markdown:
            print(f"\n**{title}**\n")
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
            for row in rows:
                print("| " + " | ".join(row) + " |")
            continue
        table = Table(title=title)
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for note in report.notes:
        print(f"- {note}" if markdown else note)
