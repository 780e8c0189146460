"""The frames as types (protocol.py): every frame has one kind and one direction, survives the
wire as itself, and a body is refused before anything is unpickled when its kind is unknown or
travels the other way."""

import dataclasses
import pickle

import pytest

from taas_magic import protocol, wire
from taas_magic.output.reports import Report
from taas_magic.protocol import KINDS, Elements, ProtocolError, ToKernel, ToPeer, Want
from taas_magic.runspec import RunSpec
from taas_magic.transfer.handoff import Closure


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
        protocol.expect(Elements(0, 0, []), Closure, "the closure")
    assert protocol.expect(Elements(0, 0, []), Elements) == Elements(0, 0, [])


def _every_kind() -> dict[str, str]:
    """Every frame kind the package defines, wherever (protocol.py, or a feature beside its sender), read from the
    source: kind -> "ToPeer" or "ToKernel"."""
    import ast
    from pathlib import Path

    kinds = {}
    for path in (Path(protocol.__file__).parent).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                kind = next((k.value.value for k in node.keywords if k.arg == "kind"), None)
                base = next((b.id for b in node.bases if isinstance(b, ast.Name) and b.id in ("ToPeer", "ToKernel")), None)
                if kind is not None and base is not None:
                    kinds[kind] = base
    return kinds


@pytest.mark.parametrize(("reader", "direction"), [("taas_magic.kernel.supervision.supervisor", "ToKernel"),
                                                   ("taas_magic.rank.main", "ToPeer")])
def test_each_reader_knows_every_kind_sent_to_it_as_soon_as_it_is_imported(reader, direction):
    """A kind decodes once the module defining it is imported: the kernel's reader must know every frame a peer
    sends, a rank's every frame the kernel sends, before the first one comes (a fresh interpreter each)."""
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-c", f"import {reader}\nfrom taas_magic import protocol\n"
                            f"print(' '.join(k for k, c in protocol.KINDS.items() if issubclass(c, protocol.{direction})))"],
                           capture_output=True, text=True, timeout=120, check=True).stdout.split()
    expected = {kind for kind, base in _every_kind().items() if base == direction}
    assert len(expected) >= 10 and set(shown) == expected
