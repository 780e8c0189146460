"""A host that does not see the notebook's repository: the marker that tells it, the rank's files sent on its
authenticated channel, and the kernel writing them into the repository (writes/away.py, outbox.py, landing.py).

The sending and the landing run over a real signed channel (wire.py's codecs, protocol.py's frames);
the clusters' own tests (tests/ray/test_away.py, tests/slurm/test_slurm_away.py) run them between
real nodes that do not share the folder.
"""

import dataclasses
import os
import socket
import tempfile
import threading
import tracemalloc

import pytest

from taas_magic import protocol, wire
from taas_magic.runspec import RunSpec
from taas_magic.wire import Placement
from taas_magic.writes import away, outbox, shared
from taas_magic.writes.landing import Landing
from taas_magic.writes.outbox import FilePart
from taas_magic.writes.savers import CheckpointSaved

MiB = 1 << 20


@pytest.fixture()
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "nb").mkdir(parents=True)
    return root


@pytest.fixture(autouse=True)
def own_temp_dir(monkeypatch, tmp_path):
    """A host's folders (away.settle's) in this test's folder, not the machine's temp dir."""
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))


@pytest.fixture()
def fresh_outbox(monkeypatch):
    monkeypatch.setattr(outbox, "_away", None)
    monkeypatch.setattr(outbox, "_shipped", False)
    monkeypatch.setattr(shared, "_held", False)
    monkeypatch.setattr(shared, "_shared", [])
    monkeypatch.setattr(shared, "_repository", None)


def _places(repo, marker):
    return [Placement(0, "rank 0", str(repo), None, "overlay", marker),
            Placement(1, "rank 1", str(repo), "/tmp/layer-of-the-kernel", "overlay", marker)]


def test_a_host_that_sees_the_marker_changes_nothing_and_the_marker_goes_at_the_end(repo):
    marker = away.Marker(str(repo))
    assert marker.name is not None and marker.name.startswith(".taas/here-")
    assert (repo / marker.name).read_text() == marker.name
    assert away.sees(str(repo), marker.name)
    assert away.settle(_places(repo, marker.name), str(repo / "nb")) is None
    assert away.settle(_places(repo, None), str(repo / "nb")) is None  # no marker: a local run, or a read-only repository
    marker.remove()
    assert not (repo / marker.name).exists()


def test_a_marker_left_by_a_dead_kernel_of_this_host_is_swept_and_another_hosts_is_not(repo):
    folder = repo / ".taas"
    folder.mkdir()
    dead = folder / f"here-999999999-{'0' * 32}@{away._HOST}"
    elsewhere = folder / f"here-999999999-{'1' * 32}@another-host"
    dead.write_text("x")
    elsewhere.write_text("x")
    away.Marker(str(repo)).remove()
    assert not dead.exists() and elsewhere.exists()


def test_a_read_only_repository_gets_no_marker(repo):
    os.chmod(repo, 0o500)
    try:
        if os.access(repo, os.W_OK):
            pytest.skip("root writes anywhere")
        assert away.Marker(str(repo)).name is None
    finally:
        os.chmod(repo, 0o700)


def test_a_host_with_another_folder_at_the_path_is_away_and_keeps_that_folder(repo):
    marker = away.Marker(str(repo))
    os.unlink(repo / marker.name)  # as a host whose folder at that path is not the notebook's sees it
    host = away.settle(_places(repo, marker.name), str(repo / "nb"))
    assert host is not None and host.root.startswith(tempfile.gettempdir())
    assert os.path.basename(host.root).startswith(f"taas-away-{os.getpid()}-")  # named by the marker's kernel
    assert host.repository == str(repo) and host.notebook == str(repo) and host.cwd == str(repo / "nb")
    placed = [host.place(place) for place in _places(repo, marker.name)]
    assert [place.away for place in placed] == [str(repo)] * 2
    assert placed[0].layer == os.path.join(host.root, "layer-0")  # rank 0 too gets a layer here
    assert placed[1].layer == os.path.join(host.root, "layer-1")  # not the kernel host's path
    assert all(os.path.isdir(place.layer) for place in placed)


def test_a_host_without_the_path_gets_a_stand_in_with_the_notebooks_working_folder_in_it(tmp_path):
    missing = tmp_path / "not-on-this-host"
    host = away.settle(_places(missing, ".taas/here-1-x@h"), str(missing / "nb" / "deeper"))
    assert host is not None
    assert host.repository == os.path.join(host.root, "repository") and host.notebook == str(missing)
    assert host.cwd == os.path.join(host.repository, "nb", "deeper") and os.path.isdir(host.cwd)
    outside = away.settle(_places(missing, ".taas/here-1-x@h"), str(tmp_path))  # the notebook works outside it
    assert outside is not None and outside.cwd == str(tmp_path)
    assert sorted(os.listdir(tmp_path / "temp")) == sorted(os.path.basename(h.root) for h in (host, outside))
    assert not missing.exists()


def test_the_rank_names_its_folders_as_the_notebooks_repository_holds_them(fresh_outbox, tmp_path):
    layer = tmp_path / "layer"
    outbox.enter(Placement(1, "rank 1", "/node/stand-in", str(layer), "overlay", "m", away="/home/nb/repo"))
    sent = []
    send = outbox.for_kernel(sent.append)
    send(CheckpointSaved("/node/stand-in/ckpt/step3", "dcp", "dcp"))
    send(CheckpointSaved("/scratch/elsewhere", "dcp", "dcp"))
    assert [frame.folder for frame in sent] == ["/home/nb/repo/ckpt/step3", "/scratch/elsewhere"]
    spec = RunSpec("r", (), "", "", "f", "cpu", "rank0", False, 1, 0, checkpoints="/home/nb/repo/.taas/checkpoints/x",
                   shared=("/home/nb/repo/out", "/scratch/o"))
    moved = outbox.here(spec)
    assert moved.checkpoints == "/node/stand-in/.taas/checkpoints/x"
    assert moved.shared == ("/node/stand-in/out", "/scratch/o")
    assert shared._held  # a folder a save names stays in the layer from now on


def _channel_pair():
    """A rank's signed channel and the kernel's reader of it, over a socket pair."""
    key, nonce = wire.new_key(), wire.new_nonce()
    ours, theirs = socket.socketpair()
    rank = wire.FrameCodec(key, nonce, outgoing=wire.RANK_TO_KERNEL, incoming=wire.KERNEL_TO_RANK)
    kernel = wire.FrameCodec(key, nonce, outgoing=wire.KERNEL_TO_RANK, incoming=wire.RANK_TO_KERNEL)
    return protocol.PeerChannel(wire.BlockingChannel(ours, rank)), theirs, wire.FrameReader(kernel)


def _land(sock, reader, landing, rank):
    """The kernel's side: frames read as the supervisor's mux reads them, each handed to the landing."""
    while data := sock.recv(MiB):
        for kind, body in reader.feed(data):
            landing.receive(rank, protocol.decode(kind, body, protocol.ToKernel))


def _ship(fresh_layer, notebook, everything_rank, landing_repo):
    channel, theirs, reader = _channel_pair()
    landing = Landing(str(landing_repo))
    kernel = threading.Thread(target=_land, args=(theirs, reader, landing, everything_rank))
    kernel.start()
    outbox.enter(Placement(everything_rank, f"rank {everything_rank}", "/node/stand-in", str(fresh_layer), "overlay", "m",
                           away=str(notebook)))
    tracemalloc.start()
    try:
        outbox.ship(channel.send)
        outbox.ship(channel.send)  # once only
        channel.close()
        kernel.join(60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        theirs.close()
    return landing, peak


def test_rank_0_sends_everything_it_wrote_and_a_big_file_never_sits_whole_in_memory(fresh_outbox, tmp_path, repo):
    upper = tmp_path / "layer" / "upper"
    (upper / "ckpt" / "step3").mkdir(parents=True)
    big = os.urandom(MiB) * 24 + b"tail"  # 24 MiB and 4 bytes: made before the measure starts
    (upper / "ckpt" / "step3" / "__0_0.distcp").write_bytes(big)
    (upper / "ckpt" / "step3" / ".metadata").write_bytes(b"")
    (upper / "model.pt").write_bytes(b"weights")
    os.symlink("/etc/passwd", upper / "link")  # not sent: a link
    os.mkfifo(upper / "fifo")  # nor anything but a regular file
    landing, peak = _ship(tmp_path / "layer", repo, 0, repo)
    print(f"peak {peak / MiB:.2f} MiB")
    assert (repo / "ckpt" / "step3" / "__0_0.distcp").read_bytes() == big
    assert (repo / "ckpt" / "step3" / ".metadata").read_bytes() == b"" and (repo / "model.pt").read_bytes() == b"weights"
    assert not (repo / "link").exists() and not (repo / "fifo").exists()
    assert not [name for name in os.listdir(repo / "ckpt" / "step3") if "incoming" in name]
    del big
    # sender and receiver together, in this process: a few pieces of outbox.CHUNK each, never the file's 24 MiB
    assert peak < 12 * outbox.CHUNK, f"{peak / MiB:.1f} MiB"
    assert landing.close() == [f"taas: 3 file(s), {(24 * MiB + 4 + 7) / 1e6:.1f} MB, written by rank(s) 0 on hosts "
                               "that do not see the repository, sent to it (first: model.pt)"]


def test_another_rank_sends_only_its_collective_saves_folders(fresh_outbox, tmp_path, repo):
    upper = tmp_path / "layer" / "upper"
    (upper / "ckpt" / "a").mkdir(parents=True)
    (upper / "ckpt" / "a" / "__1_0.distcp").write_bytes(b"part")
    (upper / "stray-1.txt").write_text("stray")
    shared._shared.append(os.path.join("ckpt", "a"))
    landing, _ = _ship(tmp_path / "layer", repo, 1, repo)
    assert (repo / "ckpt" / "a" / "__1_0.distcp").read_bytes() == b"part"
    assert not (repo / "stray-1.txt").exists()  # diverted, as on any host
    assert landing.landed == {1: [(os.path.join("ckpt", "a", "__1_0.distcp"), 4)]}


def test_the_kernel_refuses_a_path_outside_the_repository(tmp_path, repo):
    os.symlink(tmp_path, repo / "out")
    landing = Landing(str(repo))
    for path in ("../escape", "/etc/x", "out/escape", "", ".", "nb/../../escape"):
        landing.receive(1, FilePart(path, 0, b"x", True))
    assert not (tmp_path / "escape").exists() and not (tmp_path / "x").exists()
    lines = landing.close()
    assert len(lines) == 6 and all("that path is outside the repository" in line for line in lines), lines
    assert landing.target("nb/fine") == str(repo / "nb" / "fine")


def test_a_file_cut_short_or_out_of_order_never_passes_for_whole(repo):
    landing = Landing(str(repo))
    landing.receive(2, FilePart("ckpt/__2_0.distcp", 0, b"abc", False))  # the rank ended here
    landing.receive(3, FilePart("ckpt/__3_0.distcp", 0, b"abc", False))
    landing.receive(3, FilePart("ckpt/__3_0.distcp", 9, b"def", True))  # a piece out of place
    landing.receive(3, FilePart("ckpt/__3_0.distcp", 3, b"def", True))  # the rest of a dropped file: ignored
    lines = landing.close()
    assert os.listdir(repo / "ckpt") == []  # neither in place, nor its incoming file
    assert lines == ["taas: rank 3's ckpt/__3_0.distcp did not reach the repository: its piece at byte 9 came where "
                     "byte 3 was due",
                     "taas: rank 2's ckpt/__2_0.distcp did not reach the repository whole (3 bytes arrived; the rank "
                     "ended first)"]


def test_the_last_piece_replaces_what_was_there(repo):
    (repo / "ckpt").mkdir()
    (repo / "ckpt" / ".metadata").write_bytes(b"old")
    landing = Landing(str(repo))
    landing.receive(0, FilePart("ckpt/.metadata", 0, b"new", False))
    assert (repo / "ckpt" / ".metadata").read_bytes() == b"old"  # whole or not at all
    landing.receive(0, FilePart("ckpt/.metadata", 3, b"er", True))
    assert (repo / "ckpt" / ".metadata").read_bytes() == b"newer"


def test_a_frame_of_a_piece_is_a_frame_the_kernel_reads():
    part = FilePart("a/b", 5, b"xyz", True)
    assert protocol.decode_body(protocol.encode(part), protocol.ToKernel) == part
    assert dataclasses.asdict(Placement.parse(Placement(3, "rank 3", "/r", None, "python", "m", "/nb").line()))["away"] == "/nb"
