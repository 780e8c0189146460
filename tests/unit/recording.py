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
