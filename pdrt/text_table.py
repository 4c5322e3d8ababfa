"""Rows of cells as lines of text, in columns: the tables `pdrt status` and `pdrt bench` print."""


def aligned(rows: list[list[str]], right: bool = False) -> list[str]:
    """Each row as a line, its cells two spaces apart, each column as wide as its widest cell; numbers read best
    aligned `right`, names left."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    pad = str.rjust if right else str.ljust
    return ["  ".join(pad(cell, w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
