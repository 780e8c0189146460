"""CUDA IPC's contract on a host without CUDA: the probe says no and why, every fallback ends in
today's memory file with the same values, and the places it adds are understood by unpack.Blobs.

The device paths themselves run in tests/gpu/test_ipc.py. Here the exporter, the importer or
both are replaced where a test says so; everything else is the real code."""

import dataclasses
import os
import sys
import threading

import pytest
import torch

from taas_magic import protocol
from taas_magic.cell.closure import serialise_closure
from taas_magic.protocol import Elements, ToKernel, ToPeer
from taas_magic.rank.inbox import Inbox
from taas_magic.runspec import RunSpec
from taas_magic.transfer import cudaipc, memfile, returns, unpack
from taas_magic.transfer.handoff import ClosureHandoff, ClosureHostWanted, closure_route, receive_closure
from taas_magic.transfer.pack import pack
from taas_magic.transfer.results import apply_results, cuda_line, keep_result, take_device_copies
from taas_magic.transfer.returns import Released, Result, SendHost

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only contract (a GPU host runs tests/gpu)")


class _Channel:
    """A rank's channel: frames it will receive, what it sent, and a kernel answering what it asks."""

    def __init__(self, *bodies: bytes, kernel=None):
        self.frames = [protocol.decode_body(body, ToPeer) for body in bodies]
        self.sent: list[ToKernel] = []
        self.kernel = kernel

    def receive(self):
        if not self.frames:
            raise ConnectionError("peer closed the connection")
        return self.frames.pop(0)

    def readable(self, timeout):
        return bool(self.frames)

    def send(self, frame):
        frame = protocol.decode_body(protocol.encode(frame), ToKernel)  # as the kernel reads it
        self.sent.append(frame)
        if self.kernel is not None:
            self.frames.append(protocol.decode_body(self.kernel(frame), ToPeer))


def _spec(**changes) -> RunSpec:
    fields = dict(run_id="unit", sys_path=(), source="", display_source="", filename="<taas>", device="cpu",
                  output="rank0", suppress_final=False, kernel_pid=os.getpid(), result_file_bytes=1024)
    return RunSpec(**{**fields, **changes})


def _on_the_gpu(monkeypatch):
    """Every torch storage counts as a CUDA storage, and exports as torch would export one."""
    monkeypatch.setattr(cudaipc, "is_cuda", lambda blob: blob.kind == "s")
    monkeypatch.setattr(cudaipc, "export", _fake_export)


def _fake_export(blobs, indices):
    """Handles for every storage, as if each were a CUDA storage exported by torch."""
    return {i: (0, b"handle", blobs[i].nbytes, 0, b"/torch_taas_unit", 0, b"event", False)
            for i in indices if blobs[i].kind == "s"}, ""


def _result(**changes) -> Result:
    """A Result frame with nothing in it but ``changes``."""
    fields = dict(skeleton=b"", segments=[], failed=[], deleted=[], places=[], data=None, ipc=[], cuda_host=(0, 0, ""))
    return Result(**{**fields, **changes})


def _no_feeds(index):
    raise KeyError(index)


def test_the_probe_says_no_and_why_and_never_starts_cuda(monkeypatch):
    monkeypatch.delenv(cudaipc.VARIABLE, raising=False)
    if torch.cuda.is_available():
        pytest.skip("the CPU host's answer; tests/gpu/test_ipc.py covers a GPU host")
    assert not cudaipc.kernel_ready()
    assert cudaipc.unavailable() == "the kernel's torch has no CUDA"
    assert not torch.cuda.is_initialized()
    monkeypatch.setenv(cudaipc.VARIABLE, "0")
    assert cudaipc.unavailable() == "TAAS_CUDA_IPC=0" and not cudaipc.kernel_ready()
    monkeypatch.delenv(cudaipc.VARIABLE)
    monkeypatch.delitem(sys.modules, "torch")  # not imported yet: it will be, to build rank 0's tensors
    assert cudaipc.unavailable() is None


def test_without_cuda_tensors_nothing_changes_and_no_frame_is_exchanged():
    big = torch.arange(1 << 16, dtype=torch.float32)
    packing = serialise_closure({"big": big, "small": torch.ones(2)})
    assert closure_route(packing, True, 1024) == "one shared file" and closure_route(packing, False, 1 << 30) == ""
    handoff = ClosureHandoff(packing, "unit", threshold=1024, cuda_ipc=True)
    try:
        channel = _Channel(handoff.body)
        values = receive_closure(channel, own_gpu=True).load(_no_feeds)
        assert torch.equal(values["big"], big) and not channel.sent and not handoff.handles
    finally:
        handoff.remove()
    assert not torch.cuda.is_initialized()


def test_a_closure_whose_export_fails_travels_in_the_memory_file(monkeypatch, capsys):
    monkeypatch.setattr(cudaipc, "is_cuda", lambda blob: blob.kind == "s")  # as if on the GPU: the export raises
    big = torch.arange(1 << 16, dtype=torch.float32)
    packing = serialise_closure({"big": big})
    assert closure_route(packing, True, 1024) == "CUDA IPC"  # the header's promise, before the export
    handoff = ClosureHandoff(packing, "unit", threshold=1024, cuda_ipc=True)
    try:
        assert not handoff.handles and handoff.path  # the memory file serves, as it always did
        assert "taas: 1 CUDA tensor(s) of the closure, 262.1 kB, go through host memory (" in capsys.readouterr().err
        assert torch.equal(receive_closure(_Channel(handoff.body)).load(_no_feeds)["big"], big)
    finally:
        handoff.remove()


def test_a_rank_that_cannot_open_the_handles_gets_the_kernels_host_copy_and_the_others_keep_theirs(monkeypatch):
    _on_the_gpu(monkeypatch)
    big = torch.arange(1 << 16, dtype=torch.float32)
    packing = serialise_closure({"big": big, "view": big[5:9], "n": 3})
    handoff = ClosureHandoff(packing, "unit", threshold=1024, cuda_ipc=True)
    lines = []

    def kernel(request):  # the supervisor's part: answer, and say so in the cell
        assert isinstance(request, ClosureHostWanted)
        body, line = handoff.answer_host_copy(1, request)
        lines.append(line)
        return body

    try:
        assert handoff.handles and handoff.data.size == 0  # nothing for the file: the handles carry it
        failing = _Channel(handoff.body, kernel=kernel)  # on this host, opening a handle raises: no CUDA
        values = receive_closure(failing, own_gpu=False).load(_no_feeds)
        assert failing.sent[0].run == "unit" and failing.sent[0].why
        assert torch.equal(values["big"], big) and values["view"].tolist() == [5.0, 6.0, 7.0, 8.0]
        assert values["view"].untyped_storage().data_ptr() == values["big"].untyped_storage().data_ptr()
        assert lines[0].startswith("taas: rank 1 could not open the closure's CUDA tensors by CUDA IPC (")
        assert lines[0].endswith("its 1 CUDA tensor(s), 262.1 kB, came through host memory")
        host_path = handoff.host.path
        assert host_path and os.path.exists(host_path)
        _, line = handoff.answer_host_copy(2, ClosureHostWanted("another run", "stale"))  # not this run's tensors
        assert line.endswith("nor get a host copy")
        # another rank opens them: it copies them onto its device and never asks the kernel
        kernel_storage = packing.blobs[0].source
        monkeypatch.setattr(cudaipc, "open_all", lambda handles: ({i: kernel_storage for i in handles}, ""))
        monkeypatch.setattr(cudaipc, "own_copy", lambda opened, device: opened.clone())
        opening = _Channel(handoff.body)
        mine = receive_closure(opening).load(_no_feeds)
        assert not opening.sent and torch.equal(mine["big"], big)
        assert mine["big"].untyped_storage().data_ptr() != kernel_storage.data_ptr()
    finally:
        handoff.remove()
    assert not os.path.exists(host_path)
    _, line = handoff.answer_host_copy(1, ClosureHostWanted("unit", "late"))  # the cell ended: nothing left to serve
    assert line.endswith("nor get a host copy")


def _returns(namespace, spec):
    empty = ClosureHandoff(serialise_closure({}), spec.run_id)
    received = receive_closure(_Channel(empty.body))
    return returns.pack_returns(returns.CellResults(namespace, list(namespace), []), {}, received, [], spec)


def test_results_whose_export_fails_come_back_through_the_memory_file(monkeypatch, capsys):
    monkeypatch.setattr(cudaipc, "is_cuda", lambda blob: blob.kind == "s")
    t = torch.arange(1 << 16, dtype=torch.float32)
    message = _returns({"t": t}, _spec(cuda_ipc=True)).message(True)
    assert not message.ipc and take_device_copies(message) is None  # nothing to copy, nothing to answer
    ns: dict = {}
    apply_results(ns, message)
    assert torch.equal(ns["t"], t)
    err = capsys.readouterr().err
    assert "taas: 1 CUDA tensor(s), 262.1 kB, came back through host memory (" in err
    assert "Torch not compiled with CUDA enabled" in err or "CUDA" in err


def test_results_the_kernel_cannot_copy_are_sent_again_through_host_memory(monkeypatch, capsys):
    _on_the_gpu(monkeypatch)
    t = torch.arange(1 << 16, dtype=torch.float32)
    returned = _returns({"t": t, "n": 7}, _spec(cuda_ipc=True))
    first = returned.message(True)
    assert first.ipc and ("ipc", 0) in first.places and first.data.size == 0
    reply, whole = take_device_copies(first)  # on this host the kernel has no cuda:0
    assert whole is None
    channel = _Channel(protocol.encode(Elements(0, 0, [])), reply)  # a stray delivery first
    why = returns.await_kernel(Inbox(channel).take, seconds=30)
    assert why == "RuntimeError: the kernel has no cuda:0"
    second = returned.message(False, why)
    try:
        assert not second.ipc and second.data.path
        ns: dict = {}
        apply_results(ns, second)
        assert torch.equal(ns["t"], t) and ns["n"] == 7
        assert ("taas: 1 CUDA tensor(s), 262.1 kB, came back through host memory "
                "(RuntimeError: the kernel has no cuda:0)") in capsys.readouterr().err
    finally:
        memfile.remove(second.data.path)


def test_results_copied_device_to_device_are_bound_on_the_kernels_copies(monkeypatch, capsys):
    _on_the_gpu(monkeypatch)
    t = torch.arange(1 << 16, dtype=torch.float32)
    alias = t[10:20]
    message = _returns({"t": t, "alias": alias}, _spec(cuda_ipc=True)).message(True)
    copies = []
    monkeypatch.setattr(cudaipc, "take", lambda handles: copies.extend(t.untyped_storage().clone() for _ in handles) or copies)
    reply, whole = take_device_copies(message)
    assert whole is not None and protocol.decode_body(reply, ToPeer) == Released()
    assert whole.places[0] == ("made", 0) and whole.cuda_ipc == (1, t.nbytes)
    ns: dict = {}
    apply_results(ns, whole)
    assert torch.equal(ns["t"], t) and ns["t"].untyped_storage().data_ptr() == copies[0].data_ptr()
    assert ns["alias"].untyped_storage().data_ptr() == copies[0].data_ptr()  # views of one storage stay views
    assert "taas: 1 CUDA tensor(s), 262.1 kB, came back device to device (CUDA IPC)" in capsys.readouterr().out


def test_the_supervisor_keeps_only_a_whole_result_and_answers_rank_0(monkeypatch):
    plain = _result()
    kept, reply = keep_result(plain)
    assert kept is plain and reply is None  # no CUDA: kept at once, no frame sent
    exported = dataclasses.replace(plain, places=[("ipc", 0)], ipc=[(0,) * 8])
    kept, reply = keep_result(exported)  # cannot copy here
    assert kept is None and isinstance(protocol.decode_body(reply, ToPeer), SendHost)


def test_rank_0_stops_waiting_when_the_kernel_releases_it_is_gone_or_is_silent():
    released = _Channel(protocol.encode(Released()))
    assert returns.await_kernel(Inbox(released).take, seconds=30) is None and not released.frames
    assert returns.await_kernel(Inbox(_Channel()).take, seconds=30) is None  # the connection is closed
    # no answer in time: rank 0 sends its results again through host memory rather than lose them
    silent = _Channel()
    silent.receive = threading.Event().wait  # nothing comes, and the connection stays open
    assert returns.await_kernel(Inbox(silent).take, seconds=0.01) == "the kernel did not answer within 0.01 s"


def test_blobs_take_storages_made_beforehand_and_views_stay_views():
    t = torch.arange(8, dtype=torch.float32)
    packing = pack([("t", t), ("view", t[2:4]), ("other", torch.ones(3))])
    made = torch.full((8,), 5.0).untyped_storage()
    data = memfile.write(packing.blobs, "taas-test-", os.getpid(), "unit")
    places = [("made", 0), ("at", data.offsets[1], data.sizes[1])]
    blobs = unpack.Blobs(places, memfile.open_data(data, private=True), made=[made])
    values, failed = unpack.load(packing.skeleton, packing.segments, unpack.resolver(blobs))
    assert not failed and values["t"].tolist() == [5.0] * 8 and values["other"].tolist() == [1.0] * 3
    assert values["t"].untyped_storage().data_ptr() == made.data_ptr() == values["view"].untyped_storage().data_ptr()
    assert cuda_line(_result(cuda_ipc=(0, 0), cuda_host=(0, 0, ""))) is None
