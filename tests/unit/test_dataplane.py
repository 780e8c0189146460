"""The data side of a run as the kernel sets it up (kernel/supervision/dataplane.py): real loaders
registered as a notebook registers them, real plans, cache folders, launch plan, greeting and
coordinator; only the started workers' process group and a cluster's courier stand in."""

import os
import stat

import cloudpickle
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import taas
from taas_magic import protocol, wire
from taas_magic.cell.pragma import PragmaOptions, settle
from taas_magic.errors import DataPlanError
from taas_magic.kernel.supervision.dataplane import DataRun
from taas_magic.output.relay import Display
from taas_magic.peers import PeerIds
from taas_magic.procs import OWNER_VARIABLE
from taas_magic.protocol import Elements, Job, Loaders, Ready, ToPeer, Want
from taas_magic.tempdirs import ram_root
from taas_magic.writes.rule import choose_rule

SESSION = {"cache_ram": "64M", "ahead": 16, "timeout": None, "hang": 30.0, "restarts": 0, "place_timeout": 60.0, "output": "rank0", "keep": False}
HANDSHAKE = wire.Handshake("127.0.0.1", 5000, b"k" * 32).line()


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.fixture(autouse=True)
def empty_registry():
    for loader in taas.registered():
        taas.unregister(loader)
    yield
    for loader in taas.registered():
        taas.unregister(loader)


@pytest.fixture
def spill(tmp_path, monkeypatch):
    """The cache's disk folder goes under the test's own folder."""
    monkeypatch.setenv("TAAS_SPILL_DIR", str(tmp_path / "spill"))
    os.mkdir(tmp_path / "spill")
    return tmp_path / "spill"


def _data(user_ns: dict, ranks: int = 2, **options) -> DataRun:
    """The data run of every registered loader, as the kernel's plan makes it (feed = its place in the registry)."""
    settings = settle(PragmaOptions(gpus=ranks, device="cpu", **options), SESSION, ranks=ranks)
    return DataRun(dict(enumerate(taas.registered())), user_ns, settings)


def _train_loader() -> DataLoader:
    return taas.register(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))


def test_the_header_names_the_workers_and_each_loaders_plan():
    train_loader = _train_loader()
    taas.register(DataLoader(TensorDataset(torch.arange(6)), batch_size=3, shuffle=True))
    data = _data({"train_loader": train_loader}, cpus=2)
    assert data.header() == ("data: 2 workers prepare train_loader (map, 4 per pass, --units 4 = 1 pass); "
                             "a registered DataLoader (map, 2 per pass, shuffled, --units 2 = 1 pass)")
    assert _data({}, cpus=1).header().startswith("data: 1 worker prepare ")


def test_a_loader_without_len_needs_units_before_anything_starts():
    taas.register(DataLoader(Stream(), batch_size=1))
    with pytest.raises(DataPlanError, match="has no len"):
        _data({})
    assert _data({}, units=6).header() == "data: 1 worker prepare a registered DataLoader (iterable, no len, --units 6)"


def test_prepare_makes_owner_only_cache_folders_and_a_cpu_only_environment_per_worker(spill, tmp_path):
    data = _data({"train_loader": _train_loader()}, cpus=2)
    environ = dict(os.environ)
    plan = data.prepare("run1", HANDSHAKE, PeerIds(2, 2), {}, choose_rule(str(tmp_path / "repo"), "python"))
    try:
        ram, disk = data.cache_dirs()
        assert os.path.dirname(ram) == ram_root() and os.path.dirname(disk) == str(spill)
        for folder in (ram, disk):
            assert "run1" in os.path.basename(folder)
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert plan.world_size == 2 and plan.handshake == HANDSHAKE and plan.cwd == os.getcwd()
        assert [(place.peer_id, place.who, place.layer) for place in plan.places] == [
            (2, "data worker 0", None), (3, "data worker 1", None)]  # numbered after the two ranks
        for env in plan.envs:
            assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
            assert env[OWNER_VARIABLE] == f"{os.getpid()}-run1-data"
        assert dict(os.environ) == environ  # the kernel's own environment is not touched
    finally:
        data.close()
    assert not os.path.exists(ram) and not os.path.exists(disk)


@pytest.mark.parametrize("repository, layered", [("repo", True), ("", False)], ids=["elsewhere", "around the cache"])
def test_a_worker_with_a_scratch_layer_writes_there_unless_the_cache_is_inside_the_repository(
        spill, tmp_path, repository, layered):
    _train_loader()
    data = _data({}, cpus=2)
    rule = choose_rule(str(tmp_path / repository), "python")  # the test's folder holds the spill folder
    plan = data.prepare("run2", HANDSHAKE, PeerIds(1, 2), {0: "/layers/w0"}, rule)
    data.close()
    isolated = (rule.repository, "/layers/w0", "python") if layered else (None, None, None)
    assert [(place.repository, place.layer, place.write_mode) for place in plan.places] == [
        isolated, (None, None, None)]  # worker 1 has no layer


def test_the_cache_folders_and_greeting_exist_only_after_prepare(spill):
    _train_loader()
    data = _data({})
    with pytest.raises(AssertionError, match="prepare makes the cache directories first"):
        data.cache_dirs()
    with pytest.raises(AssertionError):
        data.greeting(0)


def test_a_workers_greeting_is_its_job_then_the_loaders(spill, tmp_path):
    train_loader = _train_loader()
    data = _data({"train_loader": train_loader}, ranks=1, cpus=2)
    data.prepare("run4", HANDSHAKE, PeerIds(1, 2), {}, choose_rule(str(tmp_path), "python"))
    try:
        job, loaders = (protocol.decode_body(body, ToPeer) for body in data.greeting(1))
        assert isinstance(job, Job) and isinstance(loaders, Loaders)
        assert (job.worker, job.workers, job.seed, job.plans) == (1, 2, data.seed, data.plans)
        assert job.dirs == data.cache_dirs() and job.ram_budget == (64 << 20) // 2
        assert job.segment_bytes == data.segment_bytes() == (64 << 20) // 2 // 4  # a quarter of its RAM share
        assert set(loaders.pickles) == {0}
        sent = cloudpickle.loads(loaders.pickles[0])  # as the worker loads it: the same batches
        assert [batch[0].tolist() for batch in sent] == [batch[0].tolist() for batch in train_loader]
        assert [feed.original for feed in data.rank_feeds()] == [loaders.pickles[0]]  # the ranks get the same bytes
    finally:
        data.close()


class _Courier:
    """A cluster's courier: what the data plane asks of it, recorded."""

    busy = False

    def __init__(self):
        self.restarts = 0

    def route(self, sends):
        return sends

    def ready(self):
        return []

    def restart_ranks(self) -> None:
        self.restarts += 1


def test_start_gives_the_kernels_side_of_the_started_workers(spill, tmp_path):
    data = _data({"train_loader": _train_loader()}, cpus=2)
    data.prepare("run5", HANDSHAKE, PeerIds(2, 2), {}, choose_rule(str(tmp_path), "python"))
    workers, courier, shown = object(), _Courier(), []  # the backend's group, never touched here
    try:
        plane = data.start(workers, courier, shown.append)
        assert plane.workers is workers and plane.courier is courier
        assert plane.coordinator.name_of(0) == "train_loader"
        plane.progress.show(force=True)
        assert len(shown) == 1 and isinstance(shown[0], Display)
        assert shown[0].data["text/plain"].startswith("taas data (2 workers) · train_loader: 0/4 extracted")
        with open(os.path.join(data.cache_dirs()[0], "segment"), "wb") as segment:
            segment.write(b"x" * 4096)
        assert plane.usage()[0] >= 4096 and plane.usage()[1] == 0
    finally:
        data.close()


@pytest.mark.parametrize("courier", [_Courier(), None], ids=["cluster", "this host"])
def test_restarted_ranks_read_from_the_first_element_again(spill, tmp_path, courier):
    data = _data({"train_loader": _train_loader()}, ranks=1)
    data.prepare("run6", HANDSHAKE, PeerIds(1, 1), {}, choose_rule(str(tmp_path), "python"))
    try:
        plane = data.start(object(), courier, lambda shown: None)
        coordinator = plane.coordinator
        for j in range(4):
            coordinator.on_worker(0, Ready(0, 0, j, "segment", 100 * j))
        first = coordinator.on_rank(0, Want(0, 0, 2))
        assert [send.frame for send in first] == [Elements(0, 0, [("segment", 0), ("segment", 100)])]
        plane.restart_ranks()
        assert [send.frame for send in coordinator.on_rank(0, Want(0, 0, 2))] == [send.frame for send in first]
        assert courier is None or courier.restarts == 1
    finally:
        data.close()
