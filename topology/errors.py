"""Errors shared by every netweave package.

``InputError`` is the one exception type that the command line turns into a
single line on stderr and exit code 2. Every package raises a subclass of it
for bad user input (a malformed file, an unknown GPU name, an impossible
request), so that the CLI never shows a traceback for the user's mistakes.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input: names the source (file or field), the place, and what was expected.

    >>> str(InputError("expected a number", source="topo.json", where="links[3].bw"))
    'topo.json: links[3].bw: expected a number'
    """

    def __init__(self, message: str, *, source: str | None = None, where: str | int | None = None):
        self.message = message
        self.source = source
        self.where = where
        super().__init__(self.__str__())

    def __str__(self) -> str:
        parts = []
        if self.source:
            parts.append(str(self.source))
        if self.where is not None and self.where != "":
            parts.append(f"line {self.where}" if isinstance(self.where, int) else str(self.where))
        parts.append(self.message)
        return ": ".join(parts)


class TopologyError(InputError):
    """A topology that is malformed or a query that does not fit it."""
