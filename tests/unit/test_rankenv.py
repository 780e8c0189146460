import socket

import pytest

from taas_magic.errors import LaunchError
from taas_magic.rankenv import plan_devices, rank_environment, reserve_port


def test_cpu_when_the_host_has_no_gpu():
    plan = plan_devices(8, gpus_on_host=0)
    assert (plan.device, plan.backend) == ("cpu", "gloo") and "nccl is served by gloo" in plan.notice


def test_one_gpu_per_rank_with_nccl():
    plan = plan_devices(2, gpus_on_host=8)
    assert (plan.device, plan.backend, plan.notice) == ("cuda", "nccl", None)


def test_fewer_gpus_than_ranks_is_a_clear_error():
    with pytest.raises(LaunchError, match=r"--gpus 4 asks for 4 ranks but this host has 2 GPU\(s\)"):
        plan_devices(4, gpus_on_host=2)


def test_reserved_port_is_not_handed_out_again_but_can_be_bound_by_the_store():
    reservation = reserve_port()
    port = reservation.getsockname()[1]
    others = []
    for _ in range(200):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        others.append(probe.getsockname()[1])
        probe.close()
    assert port not in others
    store = socket.socket()  # what torch's TCPStore does: SO_REUSEADDR, bind, listen
    store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    store.bind(("127.0.0.1", port))
    store.listen()
    store.close()
    reservation.close()


def test_person_set_omp_threads_wins():
    base = {"OMP_NUM_THREADS": "7", "GLOO_SOCKET_IFNAME": "eth9"}
    env = rank_environment(base, rank=1, local_rank=1, world_size=2, local_world_size=2, group_rank=0,
                           master_addr="127.0.0.1", master_port=1234, run_id="r", loopback_only=True)
    assert env["OMP_NUM_THREADS"] == "7" and env["GLOO_SOCKET_IFNAME"] == "eth9"
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "1234" and env["TORCHELASTIC_RUN_ID"] == "r"
