"""Kept ranks' bookkeeping without processes: which notebook values the ranks already have, their shape,
and the verdict's rule that a kept rank's exit is a failure."""

import torch

from taas_magic.kernel.runs.kept import NameTokens, Shape
from taas_magic.kernel.supervision.mux import FrameArrived, PeerExited
from taas_magic.kernel.supervision.verdict import Verdict
from taas_magic.peers import RANK, Peer
from taas_magic.protocol import CellDone


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
    verdict = Verdict(2, lambda peer: "localhost", kept=True)
    verdict.saw(FrameArrived(Peer(RANK, 0), CellDone(raised=False)))
    assert not verdict.ranks_exited() and verdict.running() == (1,)
    verdict.saw(FrameArrived(Peer(RANK, 1), CellDone(raised=False)))
    assert verdict.ranks_exited() and verdict.failure is None
    dying = Verdict(2, lambda peer: "localhost", kept=True)
    dying.saw(PeerExited(Peer(RANK, 1), 0))
    assert dying.failure is not None and "exited in a kept cell (code 0)" in str(dying.failure)
    plain = Verdict(2, lambda peer: "localhost")
    plain.saw(PeerExited(Peer(RANK, 1), 0))
    assert plain.failure is None
