"""A kept rank that died (killed, out of memory, a segfault), replaced by a new process while the others keep theirs.

Runs in the kernel, on the run's own thread, for the policy of kept ranks (keptcell.py), which asks it at two moments:

- a rank died in a cell, or between cells (seen as the next cell is planned): the survivors are sent ``Abandon``
  naming the dead (:func:`tell_survivors`): their collectives end, and before the next cell's code they renew
  their default group's communicator and retire their other groups (rank/abortable.py);
- the next cell starts: each dead rank's process is reaped and a new one started in its place, from a warm spare
  where there is one (launch/contract.py's ``ProcessGroup.replace``), told to join the survivors' renewed
  default group (``protocol.JOIN_VARIABLE``) when they have one; the cell's header says who died, how, and the
  names that went with it (what it said, at its last ``CellDone``, it held).

Only where the group's abort is taas's: kept ranks on CPU (gloo). Rank 0's process hosts the rendezvous store every
group is made on: its new process hosts a new one at the same address, which the survivors connect to
(rank/groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from taas_magic import protocol
from taas_magic.errors import describe_exit
from taas_magic.launch.contract import ProcessGroup
from taas_magic.peers import RANK, Peer
from taas_magic.protocol import CellDone

ReplaceRank = Callable[[int, "str | None"], None]  # a new process for that rank (joining the group renewed after...)
Send = Callable[[Peer, bytes], object]


@dataclass(frozen=True)
class Death:
    """A kept rank that died: how, and the names it held (gone with it)."""

    rank: int
    code: int
    names: tuple[str, ...]
    imports: tuple[str, ...] = ()

    def line(self) -> str:
        """The cell's header line once the rank is replaced."""
        gone = _listed([*self.names, *([f"its imports ({_listed(self.imports)})"] if self.imports else [])])
        gone = f"{gone} {'is' if len(self.names) + bool(self.imports) == 1 else 'are'} gone there" if gone else \
            "it held no names"
        source = 1 if self.rank == 0 else 0
        return (f"taas: rank {self.rank} {describe_exit(self.code)} and was replaced by a new process: {gone}; "
                f"the other ranks kept theirs (%taas heal --from {source} copies rank {source}'s)")


@dataclass(frozen=True)
class Pending:
    """Dead ranks whose new processes the next cell starts, and the run the survivors renew their groups after."""

    deaths: tuple[Death, ...]
    after: str

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(death.rank for death in self.deaths)


def dead_ranks(group: ProcessGroup) -> dict[int, int]:
    """Each dead rank's exit code."""
    return {child.index: code for child in group.children if (code := child.poll()) is not None}


def replaceable(dead: Mapping[int, int], world: int) -> bool:
    """Whether those dead ranks can be replaced while the others live on: not every rank (rank 0 too: its new
    process hosts a new rendezvous store, rank/groups.py)."""
    return bool(dead) and len(dead) < world


def tell_survivors(group: ProcessGroup, send: Send, dead: Mapping[int, int], held: Mapping[int, CellDone],
                   after: str, why: str) -> Pending:
    """``Abandon`` naming the ``dead`` to every other rank: their collectives end, their groups are renewed after
    ``after`` before the next cell (the default one joined by the new ranks)."""
    deaths = tuple(Death(rank, code, held[rank].names, held[rank].imports) if rank in held else Death(rank, code, ())
                   for rank, code in sorted(dead.items()))
    frame = protocol.encode(protocol.Abandon(after, why, tuple(sorted(dead))))
    for child in group.children:
        if child.index not in dead:
            send(Peer(RANK, child.index), frame)
    return Pending(deaths, after)


def why_dead(dead: Mapping[int, int]) -> str:
    return "; ".join(f"rank {rank} {describe_exit(code)}" for rank, code in sorted(dead.items()))


def replace(pending: Pending, held: Mapping[int, CellDone], forget: Callable[[int], None],
            start: ReplaceRank) -> list[str]:
    """Each dead rank forgotten (its channel, pipes, exit) and a new process started in its place, joining the
    survivors' default group if they have one; the lines that say so."""
    grouped = any(done.grouped for rank, done in held.items() if rank not in pending.ranks)
    lines = []
    for death in pending.deaths:
        forget(death.rank)
        start(death.rank, pending.after if grouped else None)
        lines.append(death.line())
    return lines


def _listed(names: Sequence[str], most: int = 8) -> str:
    if not names:
        return ""
    shown = list(names[:most]) + ([f"{len(names) - most} more"] if len(names) > most else [])
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
