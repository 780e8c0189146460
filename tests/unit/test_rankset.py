"""A rank set's bookkeeping without rank processes: its lifetime's policies over a real local backend (its reserved
port, its layers, its stacks folder, its server), which notebook values kept ranks already have, their shape, and
the verdict's rule that a kept rank's exit is a failure."""

import os
import types

import pytest
import torch

from taas_magic.kernel.magic.status import kept_lines
from taas_magic.kernel.runs.rankset import ONE_CELL, SESSION, NameTokens, RankSet, RankState, Shape, fetch_cell
from taas_magic.kernel.supervision import keptcell
from taas_magic.kernel.supervision.keptcell import Keeping
from taas_magic.kernel.supervision.mux import FrameArrived, PeerExited
from taas_magic.kernel.supervision.verdict import Verdict
from taas_magic.launch.local.backend import LocalBackend
from taas_magic.peers import RANK, Peer
from taas_magic.protocol import CellDone
from taas_magic.transfer.keptnames import KeptNameLost


def test_a_name_is_sent_again_only_once_the_notebook_binds_another_object_to_it():
    tokens = NameTokens()
    model, config, lr = torch.nn.Linear(2, 2), {"lr": 0.1}, 0.1
    assert tokens.unsent({"model": model, "config": config, "lr": lr}) == {"model": model, "config": config, "lr": lr}
    tokens.remember({"model": model, "config": config, "lr": lr})
    assert tokens.unsent({"model": model, "config": config, "lr": lr}) == {}
    config["lr"] = 0.5  # changed in place: not a rebinding, not sent (documented)
    assert tokens.unsent({"config": config}) == {}
    rebound = torch.nn.Linear(2, 2)
    assert tokens.unsent({"model": rebound, "lr": 0.5}) == {"model": rebound, "lr": 0.5}


def test_a_weakly_held_value_that_is_gone_counts_as_not_sent():
    tokens = NameTokens()
    tokens.remember({"model": torch.nn.Linear(2, 2)})  # nothing else holds it: collected
    again = torch.nn.Linear(2, 2)
    assert tokens.unsent({"model": again}) == {"model": again}


def test_shapes_compare_their_ranks_device_placement_and_attachment_not_their_words():
    assert Shape(2, "cpu", "this host") == Shape(2, "cpu", "this host, said otherwise")
    assert Shape(2, "cpu", "this host") != Shape(3, "cpu", "this host")
    assert Shape(4, "auto", "Ray at a:1", cluster=7) != Shape(4, "auto", "Ray at a:1", cluster=8)
    assert Shape(4, "auto", "Slurm job 3", cluster=7, per_host=2) != Shape(4, "auto", "Slurm job 3", cluster=7)
    assert str(Shape(2, "cpu", "this host")) == "2 rank(s) on cpu, this host"


def test_a_kept_rank_ends_its_cell_with_cell_done_and_its_exit_even_with_0_is_a_failure():
    verdict = Verdict(2, lambda peer: "localhost", clean_exit=Keeping.clean_exit)
    verdict.saw(FrameArrived(Peer(RANK, 0), CellDone(raised=False)))
    assert not verdict.ranks_exited() and verdict.running() == (1,)
    verdict.saw(FrameArrived(Peer(RANK, 1), CellDone(raised=False)))
    assert verdict.ranks_exited() and verdict.failure is None
    dying = Verdict(2, lambda peer: "localhost", clean_exit=Keeping.clean_exit)
    dying.saw(PeerExited(Peer(RANK, 1), 0))
    assert dying.failure is not None and "exited in a kept cell (code 0)" in str(dying.failure)
    plain = Verdict(2, lambda peer: "localhost")
    plain.saw(PeerExited(Peer(RANK, 1), 0))
    assert plain.failure is None


def _rank_set(lifetime, name: str, workers: int = 0) -> tuple[RankSet, LocalBackend]:
    backend = LocalBackend(2, None, None, device="cpu")
    ranks = RankSet(Shape(2, "cpu", "this host"), lifetime, name)
    ranks.hold(backend, workers)
    return ranks, backend


def test_one_cells_ranks_give_everything_back_as_the_cells_ranks_are_gone_and_once():
    ranks, backend = _rank_set(ONE_CELL, "runid0000001", workers=1)
    try:
        assert ranks.owner == f"{os.getpid()}-runid0000001-ranks"  # the run's tag: the run's sweep is theirs
        assert os.path.basename(ranks.stacks_dir).startswith(f"taas-stacks-{os.getpid()}-runid0000001-")
        assert ranks.server.listener.fileno() != -1 and not backend._port.closed
        ranks.cell_gone("runid0000001", workers=1)
        assert backend._port.closed  # given back as the ranks are gone: the spares warm now
        ranks.give_back()  # a second time: nothing (the release calls it again)
    finally:
        ranks.release()
    assert not os.path.exists(ranks.stacks_dir) and not os.path.exists(ranks.layers.root)
    assert ranks.server.listener.fileno() == -1
    assert ranks.lifetime.fate == "diverted and discarded"
    assert ranks.new_lines(["rank 1: 1 change"]) == ranks.new_lines(["rank 1: 1 change"]) == ["rank 1: 1 change"]


def test_the_sessions_ranks_keep_everything_past_a_cell_and_say_each_layer_line_once():
    ranks, backend = _rank_set(SESSION, "abcd1234")
    try:
        assert ranks.owner == f"{os.getpid()}-keepabcd1234-ranks"  # never a cell's tag: a cell's sweep spares them
        ranks.cell_gone("runid0000002", workers=0)
        assert not backend._port.closed and os.path.isdir(ranks.layers.root)  # kept for the next cell
        assert ranks.lifetime.fate == "diverted, kept in its layer until %taas release"
        assert ranks.new_lines(["rank 1: 1 change"]) == ["rank 1: 1 change"]
        assert ranks.new_lines(["rank 1: 1 change", "rank 1: 2 changes"]) == ["rank 1: 2 changes"]
    finally:
        ranks.release()
    assert backend._port.closed and not os.path.exists(ranks.layers.root)
    ranks.release()  # released once: a second call does nothing


def test_a_sessions_rank_server_admits_each_cells_data_workers_a_cells_only_its_own():
    one, _ = _rank_set(ONE_CELL, "runid0000003", workers=2)
    kept, _ = _rank_set(SESSION, "abcd5678")
    try:
        from taas_magic.cell.options import MAX_CPUS

        assert (len(one.peers), one.lifetime.peers_beyond_ranks(2)) == (2, 2)
        assert kept.lifetime.peers_beyond_ranks(0) == MAX_CPUS
    finally:
        one.release()
        kept.release()


class _Alive:
    """A rank's process as the set polls it: running until the test says it died."""

    def __init__(self, index: int) -> None:
        self.index, self.code = index, None

    def poll(self):
        return self.code


def test_a_sets_state_follows_its_life_new_busy_idle_lost_and_released(monkeypatch):
    ranks, _ = _rank_set(SESSION, "state123")
    try:
        assert ranks.state is RankState.NEW and "new, none running" in kept_lines(ranks)[0]
        ranks.busy_with = "runid0000004"  # a cell borrows it (kernel/runs/run.py); its ranks start
        assert ranks.state is RankState.BUSY
        children = [_Alive(0), _Alive(1)]
        ranks.ranks.group = types.SimpleNamespace(children=children, close=lambda: None)
        ranks.cell_over()
        assert ranks.state is RankState.IDLE and ranks.running
        monkeypatch.setattr(keptcell, "ALIVE_RECHECK_SECONDS", 0.0)  # polled again at once
        children[1].code = -9  # a rank dies between cells
        assert ranks.state is RankState.LOST
        assert kept_lines(ranks) == ["kept ranks: lost, none running (2 rank(s) on cpu, this host; "
                                        "rank 1 was killed by SIGKILL)"]
        ranks.ranks.close()
        ranks.ranks.lost = "every rank was stopped"
        assert ranks.state is RankState.LOST
    finally:
        ranks.release()
    assert ranks.state is RankState.RELEASED


class _Runner:
    """The magic as a rank set sees it (:class:`CellRunner`): each cell it is given run, rank 0's final value given."""

    def __init__(self, value: object) -> None:
        self.value, self.cells = value, []

    def run_cell(self, cell: str) -> object:
        self.cells.append(cell)
        return self.value


def test_the_fetch_cell_runs_on_the_kept_ranks_shape_and_ends_with_the_name():
    assert fetch_cell(Shape(2, "cpu", "this host"), "model") == (
        "#pragma taas --keep --gpus 2 --device cpu\nglobals().get('model')\n")
    assert fetch_cell(Shape(8, "cuda", "Slurm job 3", cluster=4, per_host=4), "w") == (
        "#pragma taas --keep --gpus 8 --device cuda --per-host 4\nglobals().get('w')\n")


def test_a_sets_fetch_runs_that_cell_through_its_runner_and_a_name_rank_0_lost_is_said():
    ranks, _ = _rank_set(SESSION, "fetch123")
    try:
        with pytest.raises(KeptNameLost, match="nothing here runs cells"):
            ranks.fetch("w")
        ranks.runner = _Runner(value=[1, 2])
        assert ranks.fetch("w") == [1, 2]
        assert ranks.runner.cells == ["#pragma taas --keep --gpus 2 --device cpu\nglobals().get('w')\n"]
        ranks.runner = _Runner(value=None)  # rank 0 no longer has it (the person deleted it in a kept cell)
        with pytest.raises(KeptNameLost, match="rank 0 of the kept ranks no longer has w"):
            ranks.fetch("w")
        value = [3]
        ranks.noted("w", value)
        assert ranks.names.has("w", value) and ranks.ended_why() == "released" and ranks.incarnation is None
    finally:
        ranks.release()
