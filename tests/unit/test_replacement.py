"""kernel/supervision/replacement.py: which deaths are replaced, the survivors' Abandon, and the header line."""

from taas_magic import protocol
from taas_magic.kernel.supervision import replacement
from taas_magic.peers import RANK, Peer
from taas_magic.protocol import CellDone


class _Child:
    def __init__(self, index: int, code: int | None) -> None:
        self.index, self.code, self.host = index, code, "localhost"

    def poll(self) -> int | None:
        return self.code


class _Group:
    def __init__(self, codes: list[int | None]) -> None:
        self.children = [_Child(index, code) for index, code in enumerate(codes)]


def test_any_rank_but_never_every_rank_is_replaced():
    assert replacement.replaceable({1: -9}, 2) and replacement.replaceable({1: -9, 2: -11}, 4)
    assert replacement.replaceable({0: -9}, 2)  # its new process hosts a new rendezvous store
    assert not replacement.replaceable({}, 2)  # nothing died
    assert not replacement.replaceable({1: -9, 2: -9}, 2)  # every rank (of a world of 2 named 1 and 2: a guard)


def test_the_survivors_alone_are_told_naming_the_dead_and_the_line_says_what_went_with_it():
    group = _Group([None, -9, None])
    sent: list[tuple[Peer, bytes]] = []
    held = {1: CellDone(False, ("model", "opt", "step"), ("torch",), True), 0: CellDone(False, (), (), True)}
    pending = replacement.tell_survivors(group, lambda peer, body: sent.append((peer, body)),
                                         replacement.dead_ranks(group), held, "run-1", "rank 1 was killed by SIGKILL")
    assert [peer for peer, _ in sent] == [Peer(RANK, 0), Peer(RANK, 2)]
    assert protocol.decode_body(sent[0][1], protocol.ToPeer) == protocol.Abandon("run-1", "rank 1 was killed by SIGKILL",
                                                                                  (1,))
    assert pending.ranks == (1,) and pending.after == "run-1"
    assert pending.deaths[0].line() == (
        "taas: rank 1 was killed by SIGKILL and was replaced by a new process: model, opt, step and its imports (torch) "
        "are gone there; the other ranks kept theirs (%taas heal --from 0 copies rank 0's)")
    started: list[tuple[int, str | None]] = []
    forgotten: list[int] = []
    lines = replacement.replace(pending, held, forgotten.append, lambda rank, joins: started.append((rank, joins)))
    assert forgotten == [1] and started == [(1, "run-1")] and lines == [pending.deaths[0].line()]
    no_group = {0: CellDone(False, (), (), False)}
    replacement.replace(pending, no_group, forgotten.append, lambda rank, joins: started.append((rank, joins)))
    assert started[-1] == (1, None)  # the survivors have no default group: nothing to join
    assert replacement.Death(0, -9, ()).line().endswith("(%taas heal --from 1 copies rank 1's)")
    assert replacement.Death(2, -11, ()).line().startswith("taas: rank 2 was killed by SIGSEGV and was replaced by a "
                                                            "new process: it held no names;")
