"""The frames as types (protocol.py): every frame has one kind and one direction, survives the
wire as itself, and a body is refused before anything is unpickled when its kind is unknown or
travels the other way."""

import dataclasses
import pickle

import pytest

from taas_magic import protocol, wire
from taas_magic.protocol import KINDS, Elements, ProtocolError, Report, ToKernel, ToPeer, Want
from taas_magic.runspec import RunSpec


class _Detonator:
    def __reduce__(self):
        return (pytest.fail, ("a refused frame was unpickled",))


def _sample(cls: type[protocol.Frame]) -> protocol.Frame:
    """A frame of ``cls`` with a plain value in every field."""
    values = {"spec": RunSpec("run", (), "", "", "<taas>", "cpu", "rank0", False, 1, 1024)}
    return cls(**{field.name: values.get(field.name, 1) for field in dataclasses.fields(cls)})


def test_every_frame_is_frozen_and_has_one_kind_and_one_direction():
    assert len(KINDS) >= 20
    for kind, cls in KINDS.items():
        assert cls.KIND == kind and dataclasses.is_dataclass(cls)
        assert issubclass(cls, ToPeer) != issubclass(cls, ToKernel), cls
        assert cls.DIRECTION == (wire.KERNEL_TO_RANK if issubclass(cls, ToPeer) else wire.RANK_TO_KERNEL)
        assert cls.__dataclass_params__.frozen, cls


def test_every_frame_comes_out_as_it_went_in():
    for cls in KINDS.values():
        frame = _sample(cls)
        direction = ToPeer if isinstance(frame, ToPeer) else ToKernel
        assert protocol.decode_body(protocol.encode(frame), direction) == frame


def test_frames_are_dispatched_by_type():
    def route(frame: protocol.Frame) -> str:
        match frame:
            case Report(reports=reports):
                return f"{len(reports)} reports"
            case Want(feed=feed, credit=credit):
                return f"feed {feed} +{credit}"
        return "other"

    assert route(Report(1.0, [(0, {"loss": 1.0})], None)) == "1 reports"
    assert route(Want(3, 0, 4)) == "feed 3 +4"


def test_unknown_kinds_and_frames_of_the_other_direction_are_refused_before_unpickling():
    detonating = pickle.dumps(_Detonator())
    with pytest.raises(ProtocolError, match="unknown kind 'boom'"):
        protocol.decode("boom", detonating, ToKernel)
    with pytest.raises(ProtocolError, match="'elements' frame the wrong way"):
        protocol.decode(Elements.KIND, detonating, ToKernel)  # a peer cannot send what only the kernel sends
    with pytest.raises(ProtocolError, match="'report' frame the wrong way"):
        protocol.decode(Report.KIND, detonating, ToPeer)


def test_a_kind_whose_pickle_is_another_frame_is_refused():
    body = wire.encode_body(Report.KIND, wire.dumps(Want(0, 0, 1)))
    with pytest.raises(ProtocolError, match="'report' frame holding Want"):
        protocol.decode_body(body, ToKernel)


def test_a_peer_expecting_one_frame_names_what_came_instead():
    with pytest.raises(ConnectionError, match="expected the closure from the kernel, got a 'elements' frame"):
        protocol.expect(Elements(0, 0, []), protocol.Closure, "the closure")
    assert protocol.expect(Elements(0, 0, []), Elements) == Elements(0, 0, [])
