"""taas.report in a rank (output/reports.py): numbers and tensors become plain numbers, in order and
numbered as reported; a value whose copy to the host is still in flight holds back its report and
the ones after it, never reorders them; flush waits for it. No CUDA needed: the copies in flight
are :class:`reports.Staged` values with fake events."""

import sys
from types import SimpleNamespace

import pytest
import torch

from taas_magic import protocol
from taas_magic.output import reports
from taas_magic.output.reports import Report


class Channel:
    def __init__(self):
        self.messages = []

    def send(self, frame):
        assert type(frame) is Report
        self.messages.append(protocol.decode_body(protocol.encode(frame), protocol.ToKernel))  # as the kernel reads it

    def reports(self):
        return [report for message in self.messages for report in message.reports]


class Event:
    """A CUDA event's surface: query() answers from ``answers`` (then True); synchronize() completes it."""

    def __init__(self, *answers, fails=False):
        self.answers, self.fails, self.synchronized, self.queries = list(answers), fails, False, 0

    def query(self):
        self.queries += 1
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.synchronized or (self.answers.pop(0) if self.answers else True)

    def record(self, stream):
        self.recorded_on = stream

    def synchronize(self):
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.synchronized = True


class Pool:
    def __init__(self):
        self.back = []

    def give_back(self, staged):
        self.back.append(staged)


@pytest.fixture
def channel(monkeypatch):
    sent = Channel()
    monkeypatch.setattr(reports, "_channel", sent)
    monkeypatch.setattr(reports, "_sent", 0)
    reports._pending.clear()
    yield sent
    reports._pending.clear()


def staged(value, *answers, **options):
    return reports.Staged(torch.tensor(value), Event(*answers, **options), Pool())


def test_numbers_cpu_tensors_and_non_scalars(channel):
    reports.report(step=3, loss=0.5, count=7)
    reports.report(loss=torch.tensor(1.25), acc=torch.tensor([0.5]), big=torch.ones(3), name="x", none=None)
    reports.report(step=torch.tensor(9), lr=torch.tensor(0.1, dtype=torch.float64))
    reports.report(step=2.0, flag=torch.tensor(True))
    reports._send(health=False)
    assert channel.reports() == [(3, {"loss": 0.5, "count": 7}), (1, {"loss": 1.25, "acc": 0.5}),
                                 (9, {"lr": 0.1}), (2, {"flag": 1.0})]
    assert type(channel.reports()[2][0]) is int


def test_plain_numbers_are_kept_as_they_are(channel):
    metrics = {"loss": 0.5}
    reports.report(**metrics)
    assert reports._pending == [(None, metrics)]  # the fast path: no conversion in the training thread


def test_order_and_numbering_across_batches(channel):
    for step in range(5):
        reports.report(loss=float(step))
    reports._send(health=False)
    reports.report(loss=torch.tensor(5.0))
    reports.report(step=100, loss=6)
    reports.report(loss=7.0)
    reports._send(health=False)
    assert [step for step, _ in channel.reports()] == [0, 1, 2, 3, 4, 5, 100, 7]
    assert [metrics["loss"] for _, metrics in channel.reports()] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_a_copy_in_flight_holds_back_its_report_and_the_later_ones(channel):
    late = staged(2.5, False)  # query(): False, then True
    reports.report(loss=1.0)
    reports.report(loss=late, lr=0.1)
    reports.report(loss=3.0)
    reports._send(health=False)
    assert channel.reports() == [(0, {"loss": 1.0})]
    assert late.pool.back == []  # not read yet: its slot is still in use
    reports.report(loss=4.0)
    reports._send(health=False)
    assert channel.reports() == [(0, {"loss": 1.0}), (1, {"loss": 2.5, "lr": 0.1}), (2, {"loss": 3.0}),
                                 (3, {"loss": 4.0})]
    assert late.pool.back == [late]  # read once, then given back for the next report


def test_nothing_ready_sends_nothing_but_health_still_goes(channel):
    reports.report(loss=staged(1.0, False, False))
    reports._send(health=False)
    assert channel.messages == []
    reports._send(health=True)
    assert channel.messages[-1].reports == [] and "cpu" in channel.messages[-1].health
    reports._send(health=False)
    assert channel.reports() == [(0, {"loss": 1.0})]


def test_every_staged_value_of_a_report_must_be_ready(channel):
    first, second = staged(1.0), staged(2.0, False)
    reports.report(a=first, b=second)
    reports._send(health=False)
    assert channel.reports() == [] and first.pool.back == []  # neither read: the report is sent whole, later
    reports._send(health=False)
    assert channel.reports() == [(0, {"a": 1.0, "b": 2.0})]


def test_a_staged_step(channel):
    reports.report(step=staged(41, False), loss=0.5)
    reports._send(health=False)
    assert channel.reports() == []
    reports._send(health=False)
    assert channel.reports() == [(41, {"loss": 0.5})]


def test_flush_waits_for_the_copies_in_flight(channel):
    events = [staged(float(i), *[False] * 100) for i in range(3)]
    for value in events:
        reports.report(loss=value)
    reports.flush()
    assert [metrics["loss"] for _, metrics in channel.reports()] == [0.0, 1.0, 2.0]
    assert all(value.event.synchronized for value in events)


def test_flush_on_the_error_path_gives_up_on_a_copy_that_never_completes(channel, monkeypatch):
    monkeypatch.setattr(reports, "ERROR_WAIT_SECONDS", 0.05)
    stuck = reports.Staged(torch.tensor(1.0), Event(*[False] * 10**6), Pool())
    reports.report(loss=0.5)
    reports.report(loss=stuck, lr=0.1)
    reports.report(loss=2.0)
    try:
        raise ValueError("the cell raised")
    except ValueError:
        reports.flush()  # as _send_error calls it
    assert channel.reports() == [(0, {"loss": 0.5}), (1, {"lr": 0.1}), (2, {"loss": 2.0})]
    assert not stuck.event.synchronized and stuck.pool.back == []  # still in flight: its slot is never reused


def test_a_failed_copy_leaves_its_value_out_and_the_reports_go_on(channel):
    reports.report(loss=reports.Staged(torch.tensor(1.0), Event(fails=True), Pool()), lr=0.1)
    reports.report(loss=reports.Staged(torch.tensor(2.0), Event(fails=True), Pool()))
    reports._send(health=False)
    reports.report(loss=3.0)
    reports.flush()
    assert channel.reports() == [(0, {"lr": 0.1}), (1, {}), (2, {"loss": 3.0})]


def test_the_pool_copies_into_pinned_slots_and_reuses_them(channel):
    allocations = []

    def empty(size, dtype, pin_memory):
        assert pin_memory
        allocations.append((size, dtype))
        return torch.full((size,), -1.0, dtype=dtype)

    # torch as the pool uses it (it is handed torch, so a CPU tensor stands in for a CUDA one)
    fake_torch = SimpleNamespace(empty=empty, cuda=SimpleNamespace(Event=Event, current_stream=lambda device: "stream"))
    pool = reports.SlotPool()
    loss = torch.tensor([[2.5]], requires_grad=True) * 1
    first = pool.stage(fake_torch, loss)
    assert first.event.recorded_on == "stream" and first.buffer.shape == ()
    assert first.item() == 2.5
    second = pool.stage(fake_torch, torch.tensor(3.5))
    assert second.buffer.data_ptr() == first.buffer.data_ptr() and second.event is first.event  # the slot, reused
    held = [pool.stage(fake_torch, torch.tensor(float(i))) for i in range(reports.SLAB)]
    assert allocations == [(reports.SLAB, torch.float32)] * 2  # one pinned slab per SLAB slots in flight
    assert [value.item() for value in held] == [float(i) for i in range(reports.SLAB)] and second.item() == 3.5
    pool.stage(fake_torch, torch.tensor(1, dtype=torch.int64))
    assert allocations[-1] == (reports.SLAB, torch.int64)  # by dtype: no conversion, the bytes as they are


def test_without_cuda_a_tensor_is_not_staged(channel):
    value = torch.tensor(1.0)
    assert reports._stage(value) is value
    assert reports._stage("text") == "text"


def test_report_does_not_import_torch(channel, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    reports.report(loss=object())
    reports._send(health=False)
    assert channel.reports() == [(0, {})]


def test_send_without_a_channel_is_a_no_op(monkeypatch):
    monkeypatch.setattr(reports, "_channel", None)
    reports._send(health=True)
    reports.flush()
