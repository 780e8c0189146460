"""launch/engines.py: which engine ``%taas cluster`` and ``$TAAS_CLUSTER`` reach, and the local engine's parts.

No cluster runs here: an engine is reached for real and answers with the error a person sees where this
host lacks it (Slurm's commands off ``PATH``; a Ray address nothing listens at, in an interpreter of its
own so Ray is imported there and not in pytest's). The local engine's backend and spare pool are made
for real on this host; how many GPUs it has is set through ``TAAS_VISIBLE_GPUS``, the host's override.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from taas_magic.errors import ClusterError, LaunchError
from taas_magic.launch.engines import ADDRESSES, CLUSTER_WORDS, ENVIRONMENT, attach, local_backend, warm_spares
from taas_magic.launch.local.backend import LocalBackend
from taas_magic.launch.local.spares import SparePool
from taas_magic.wire import LOOPBACK


@pytest.fixture()
def no_slurm(monkeypatch, tmp_path):
    """A PATH without Slurm's commands."""
    (tmp_path / "empty-bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.mark.parametrize("setting", [None, "off", "local", "", "  local  "])
def test_without_a_cluster_or_with_off_or_local_cells_run_on_this_host(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv(ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(ENVIRONMENT, setting)
    assert attach(None) is None  # at load
    assert attach(setting or "") is None  # %taas cluster off / local


def test_the_slurm_word_reaches_the_slurm_engine_which_says_what_this_host_lacks(no_slurm):
    with pytest.raises(ClusterError) as raised:
        attach("--partition gpu", show=print, word="slurm")
    assert str(raised.value) == ("taas: Slurm's commands are not on this host's PATH "
                                 "(salloc, srun, squeue, scontrol, scancel, sinfo not found)")


def test_taas_cluster_slurm_at_load_takes_its_first_word_as_the_engine(no_slurm, monkeypatch):
    monkeypatch.setenv(ENVIRONMENT, "slurm --partition gpu")
    with pytest.raises(ClusterError, match="Slurm's commands are not on this host's PATH"):
        attach(None)


def test_an_unknown_word_is_an_engine_no_one_named():
    with pytest.raises(KeyError):
        attach("", word="kubernetes")
    assert list(CLUSTER_WORDS) == ["slurm"]
    assert CLUSTER_WORDS["slurm"].argument == "OPTIONS" and ADDRESSES.argument == "ADDRESS|local"


def test_anything_else_is_a_ray_address_tried_at_once_and_the_local_mode_imports_no_engine():
    """In an interpreter of its own: what it imported is what the mode pays for."""
    with socket.socket() as closed:
        closed.bind((LOOPBACK, 0))
        port = closed.getsockname()[1]  # nothing listens once it is closed
    script = textwrap.dedent(f"""
        import os, sys
        from taas_magic.errors import ClusterError
        from taas_magic.launch import engines
        assert engines.attach(None) is None
        with engines.local_backend(1, None, None, "cpu"):
            pass
        print("local imported:", sorted(m for m in ("ray", "taas_magic.launch.ray", "taas_magic.launch.slurm")
                                        if m in sys.modules))
        for given in ("127.0.0.1:{port}", None):  # a %taas cluster line, then $TAAS_CLUSTER at load
            os.environ["TAAS_CLUSTER"] = "ray://127.0.0.1:{port}"
            try:
                engines.attach(given)
            except ClusterError as exc:
                print(exc)
    """)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd(), "TAAS_VISIBLE_GPUS": "0"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "local imported: []" and len(lines) == 3
    if importlib.util.find_spec("ray") is None:  # the declared minimums: no [ray] extra, and the line says so
        assert lines[1] == lines[2] == "taas: the cluster mode needs Ray: pip install \"taas-magic[ray]\" (No module named 'ray')"
        return
    assert lines[1].startswith(f"taas: no Ray cluster answers at '127.0.0.1:{port}' (")
    assert lines[2].startswith(f"taas: no Ray cluster answers at 'ray://127.0.0.1:{port}' (")
    assert lines[1].endswith("; check the address (ray status shows it)")


def test_warm_spares_start_with_none_and_start_nothing():
    pool = warm_spares()
    try:
        assert isinstance(pool, SparePool)
        assert pool.spares == [] and pool.factory is None
    finally:
        pool.close()


def test_a_local_backend_on_cpu_holds_its_master_port_until_released(monkeypatch):
    monkeypatch.setenv("TAAS_VISIBLE_GPUS", "0")
    with local_backend(3, None, None) as backend:
        assert isinstance(backend, LocalBackend)
        assert (backend.devices.device, backend.devices.backend) == ("cpu", "gloo")
        assert [slot.rank for slot in backend.slots] == [0, 1, 2]
        host, port = backend.master()
        assert host == LOOPBACK
        with socket.socket() as other:  # held: no one else is given it
            with pytest.raises(OSError):
                other.bind((LOOPBACK, port))
    with socket.socket() as other:
        other.bind((LOOPBACK, port))  # released


def test_a_local_backend_the_host_cannot_serve_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setenv("TAAS_VISIBLE_GPUS", "0")
    with pytest.raises(LaunchError, match=r"^taas: --device cuda, but this host has no GPU"):
        local_backend(1, None, None, device="cuda")
    monkeypatch.setenv("TAAS_VISIBLE_GPUS", "1")
    with pytest.raises(LaunchError) as raised:
        local_backend(2, None, None)
    assert str(raised.value) == ("taas: --gpus 2 asks for 2 ranks but this host has 1 GPU(s); "
                                 "use --gpus 1, --gpus auto or --device cpu, or attach a cluster")
    with local_backend(1, None, None, device="cpu") as backend:  # --device cpu on a GPU host: GPUs hidden
        assert backend.devices.device == "cpu" and backend.rank_extra_env(0) == {"CUDA_VISIBLE_DEVICES": ""}


def test_the_local_engine_takes_only_its_own_spares():
    class OtherSpares:
        pass

    with pytest.raises(AssertionError, match="the local engine's spares are warm_spares"):
        local_backend(1, OtherSpares(), None, "cpu")  # type: ignore[arg-type]
