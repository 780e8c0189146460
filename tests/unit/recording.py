"""A relay stream for unit tests (output/relay.py's ``TextOut``): what was written to it, in order."""


class WrittenText:
    def __init__(self):
        self.written: list[str] = []

    def write(self, text: str) -> int:
        self.written.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.written)


class RecordedCell:
    """What a cell received, in order: ``("stdout"|"stderr", text)`` for each write, ``("display", message)`` for each
    display; its ``streams`` are what a relay or a view writes to, ``publish`` what it displays with."""

    def __init__(self):
        self.got: list[tuple[str, object]] = []
        self.streams = {name: _CellStream(self, name) for name in ("stdout", "stderr")}

    def publish(self, message) -> None:
        self.got.append(("display", message))

    def text(self, name: str = "stdout") -> str:
        return "".join(text for kind, text in self.got if kind == name)


class _CellStream:
    def __init__(self, cell: RecordedCell, name: str):
        self.cell, self.name = cell, name

    def write(self, text: str) -> int:
        self.cell.got.append((self.name, text))
        return len(text)

    def flush(self) -> None:
        pass
