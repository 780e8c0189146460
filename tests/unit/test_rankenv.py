import errno
import socket

import pytest

from taas_magic.errors import LaunchError
from taas_magic.launch.placement import RankSlot
from taas_magic.launch.rankenv import (
    RankChoice,
    Rendezvous,
    choose_ranks,
    idle_cores,
    plan_devices,
    rank_environment,
)
from taas_magic.wire import PortReservation


def test_cpu_when_the_host_has_no_gpu():
    plan = plan_devices(8, gpus_on_host=0)
    assert (plan.device, plan.backend) == ("cpu", "gloo") and "nccl is served by gloo" in plan.notice


def test_one_gpu_per_rank_with_nccl():
    plan = plan_devices(2, gpus_on_host=8)
    assert (plan.device, plan.backend, plan.notice) == ("cuda", "nccl", None)


def test_fewer_gpus_than_ranks_is_a_clear_error():
    with pytest.raises(LaunchError, match=r"--gpus 4 asks for 4 ranks but this host has 2 GPU\(s\); use --gpus 2, --gpus auto or --device cpu"):
        plan_devices(4, gpus_on_host=2)


def _addresses() -> list[tuple[socket.AddressFamily, str]]:
    """This host's addresses a socket can bind: loopback of both families, its name's, the default route's."""
    found = {(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")}
    for family, _, _, _, address in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP):
        found.add((family, address[0]))
    for family, remote in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connecting a datagram socket sends nothing
            try:
                probe.connect((remote, 9))
                found.add((family, probe.getsockname()[0]))
            except OSError:
                pass  # no route of that family
    return sorted(found)


def test_reserved_port_is_taken_on_every_address_yet_the_store_binds_it():
    # held on loopback only, a port-0 bind on the host's other address could be given the same port (8 in 60000
    # binds on 192.0.2.2 here), and a gloo listener there made rank 0's store fail with EADDRINUSE (CI, 2026-11-28).
    # A port-0 bind takes a port only where a plain bind of it would succeed; that is what is checked, on every address
    reservation = PortReservation()
    try:
        for family, address in _addresses():
            with socket.socket(family) as other:
                try:
                    other.bind((address, reservation.port))
                except OSError as refused:
                    assert refused.errno == errno.EADDRINUSE, (address, refused)
                else:
                    pytest.fail(f"port {reservation.port} could be bound on {address}")
        with socket.socket() as store:  # what torch's TCPStore does: SO_REUSEADDR, bind (every address), listen
            store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            store.bind(("0.0.0.0", reservation.port))
            store.listen()
    finally:
        reservation.close()
    assert reservation.closed


def test_person_set_omp_threads_wins():
    base = {"OMP_NUM_THREADS": "7", "GLOO_SOCKET_IFNAME": "eth9"}
    slot = RankSlot(rank=1, local_rank=1, local_world_size=2, group_rank=0)
    env = rank_environment(base, slot, Rendezvous("127.0.0.1", 1234, world_size=2, run_id="r"), loopback_only=True)
    assert env["OMP_NUM_THREADS"] == "7" and env["GLOO_SOCKET_IFNAME"] == "eth9"
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "1234" and env["TORCHELASTIC_RUN_ID"] == "r"


def test_device_cpu_on_a_gpu_host_hides_the_gpus_and_says_so():
    plan = plan_devices(2, gpus_on_host=8, device="cpu")
    assert (plan.device, plan.backend, plan.hides_gpus) == ("cpu", "gloo", True)
    assert "--device cpu" in plan.notice and "see none of this host's 8 GPU(s)" in plan.notice


def test_device_cpu_on_a_cpu_host_hides_nothing():
    plan = plan_devices(2, gpus_on_host=0, device="cpu")
    assert (plan.device, plan.hides_gpus) == ("cpu", False)


def test_device_cuda_without_gpus_is_a_one_line_error():
    with pytest.raises(LaunchError) as info:
        plan_devices(1, gpus_on_host=0, device="cuda")
    assert "--device cuda, but this host has no GPU" in str(info.value) and "\n" not in str(info.value)


def test_device_cuda_with_gpus_is_nccl():
    assert plan_devices(2, gpus_on_host=2, device="cuda").backend == "nccl"


@pytest.mark.parametrize(
    ("gpus", "device", "on_host", "ranks", "why"),
    [
        (3, "auto", 0, 3, None),  # a number is a number, whatever the host
        ("auto", "auto", 8, 8, "--gpus auto: one per GPU of this host"),
        ("auto", "auto", 1, 1, "--gpus auto: one per GPU of this host"),
        ("auto", "cuda", 2, 2, "--gpus auto: one per GPU of this host"),
        ("auto", "auto", 0, 2, "--gpus auto: no GPU on this host, so 2 CPU ranks to show DDP"),
        ("auto", "cpu", 8, 2, "--gpus auto with --device cpu: 2 CPU ranks"),
    ],
)
def test_gpus_auto_is_one_rank_per_gpu_or_two_cpu_ranks(gpus, device, on_host, ranks, why):
    assert choose_ranks(gpus, device, lambda: on_host) == RankChoice(ranks, why)


def test_gpus_auto_with_device_cuda_on_a_cpu_host_fails_in_the_device_plan():
    choice = choose_ranks("auto", "cuda", lambda: 0)
    with pytest.raises(LaunchError, match="--device cuda"):
        plan_devices(choice.ranks, gpus_on_host=0, device="cuda")


@pytest.mark.parametrize(("cores", "ranks", "idle"), [(16, 1, True), (16, 4, True), (16, 8, False), (2, 2, False),
                                                      (2, 1, False), (96, 8, True)])
def test_spares_warm_during_a_run_only_where_the_ranks_leave_most_cores_idle(monkeypatch, cores, ranks, idle):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert idle_cores(ranks) is idle
