"""launch/slurm/attachment.py: ``%taas cluster slurm [OPTIONS]`` attaches the job the kernel runs in, or a new
allocation shown while queued, and lets go of only what it made.

A real Slurm runs in tests/slurm (minutes); here Slurm's commands are small stand-ins on ``PATH`` that keep
one job's state in a file and log every call, so the attachment's whole path runs for real: the allocation
keeper (``python -m taas_magic.launch.slurm.allocation``) starting ``salloc``, salloc's stderr read for the
job id, the queue line shown, the probe step (the stand-in ``srun`` runs the real probe command here),
the release through the keeper's pipe, and ``scancel`` where, and only where, taas must cancel.
"""

from __future__ import annotations

import glob
import os
import re
import stat
import sys
import textwrap
import threading

import pytest

from taas_magic.errors import ClusterError, LaunchError
from taas_magic.launch.rankenv import CLUSTER_CPU
from taas_magic.launch.slurm import allocation
from taas_magic.launch.slurm.attachment import SlurmCluster
from taas_magic.launch.slurm.backend import SlurmBackend

pytestmark = pytest.mark.unpinned  # the kernel's Slurm engine: nothing of the minimums' pins (.ci/run)

LOG = 'echo "$(basename "$0") $* [SLURM_JOB_ID=${SLURM_JOB_ID-unset}]" >> "$STATE/calls.log"'
JOB = """JobId=@ID@ JobName=interactive
   UserId=ada(1000) GroupId=ada(1000) MCS_label=N/A
   JobState=@STATE@ Reason=@REASON@ Dependency=(null)
   RunTime=00:00:01 TimeLimit=01:00:00 TimeMin=N/A
   Partition=gpu AllocNode:Sid=login1:21734
   NodeList=node1
   NumNodes=1 NumCPUs=4 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   JOB_GRES=gpu:2
     Nodes=node1 CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
"""

COMMANDS = {
    "scontrol": f"""
        {LOG}
        case "$1 $2" in
          "show hostnames") echo "$3" ;;
          "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 State=IDLE" ;;
          "show job")
            shift 2; [ "$1" = -d ] && shift
            [ -e "$STATE/job-$1" ] || {{ echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }}
            read state reason < "$STATE/job-$1"
            sed -e "s/@ID@/$1/" -e "s/@STATE@/$state/" -e "s/@REASON@/$reason/" "$STATE/job.template"
            ;;
        esac
    """,
    "srun": f"""
        {LOG}
        while [ "${{1#-}}" != "$1" ]; do shift; done  # its options: the step is this host
        SLURMD_NODENAME=node1 exec "$@"
    """,
    "squeue": f"""
        {LOG}
        case "$*" in *%L*) echo "59:00" ;; *PENDING*) echo 70; echo 77 ;; esac
    """,
    "sinfo": f"""
        {LOG}
        echo "node1 idle"
    """,
    "scancel": f"""
        {LOG}
        for job; do case "$job" in -*) ;; *) echo "CANCELLED None" > "$STATE/job-$job" ;; esac; done
    """,
    # salloc in Python: while queued it has no child (the keeper reads that as "queued": SIGTERM revokes it).
    "salloc": """
        import os, signal, subprocess, sys, time
        state = os.environ["STATE"]
        def job(text):
            with open(os.path.join(state, "job-77"), "w") as f:
                f.write(text + "\\n")
        with open(os.path.join(state, "calls.log"), "a") as log:
            log.write("salloc " + " ".join(sys.argv[1:]) + f" [SLURM_JOB_ID={os.environ.get('SLURM_JOB_ID', 'unset')}]\\n")
        if "--partition=nope" in sys.argv:
            print("salloc: error: invalid partition specified: nope", file=sys.stderr, flush=True)
            print("salloc: error: Job submit/allocate failed: Invalid partition name specified", file=sys.stderr, flush=True)
            sys.exit(1)
        def revoked(*_):
            job("CANCELLED None")
            print("salloc: Job allocation 77 has been revoked.", file=sys.stderr, flush=True)
            sys.exit(1)
        signal.signal(signal.SIGTERM, revoked)
        job("PENDING Resources")
        print("salloc: Pending job allocation 77", file=sys.stderr, flush=True)
        print("salloc: job 77 queued and waiting for resources", file=sys.stderr, flush=True)
        while not os.path.exists(os.path.join(state, "grant")):
            time.sleep(0.02)
        job("RUNNING None")
        print("salloc: job 77 has been allocated resources", file=sys.stderr, flush=True)
        print("salloc: Granted job allocation 77", file=sys.stderr, flush=True)
        subprocess.run(sys.argv[-1:])  # salloc's command, on salloc's stdin: the keeper's pipe
        job("COMPLETED None")
        print("salloc: Relinquishing job allocation 77", file=sys.stderr, flush=True)
    """,
}
PYTHON = ("salloc",)


@pytest.fixture()
def slurm(tmp_path, monkeypatch):
    """Slurm's commands on PATH, their state and log in ``tmp_path / "state"``."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in COMMANDS.items():
        text = f"#!{sys.executable if name in PYTHON else '/bin/bash'}\n" + textwrap.dedent(body).lstrip("\n")
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("STATE", str(state))
    monkeypatch.setenv("TAAS_SLURM_ADDRESS", "127.0.0.1")
    monkeypatch.setattr(allocation, "QUEUE_REFRESH", 0.05)  # the queue shown every 50 ms, not every second
    (state / "job.template").write_text(JOB)
    (state / "job-42").write_text("RUNNING None\n")  # the kernel's own job
    return state


def _calls(state, command: str) -> list[str]:
    log = state / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.split()[0] == command]


def test_without_slurms_commands_attaching_says_which_are_missing(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(ClusterError) as raised:
        SlurmCluster.attach("", None)
    assert str(raised.value) == ("taas: Slurm's commands are not on this host's PATH "
                                 "(salloc, squeue, scontrol, scancel, sinfo not found)")


def test_at_load_outside_a_job_nothing_is_queued_and_the_error_says_what_to_give(slurm, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ClusterError, match=r"this kernel does not run inside a Slurm job \(SLURM_JOB_ID is not set\)"):
        SlurmCluster.attach("--gpus-per-node 4", None)  # at load: options or not, no salloc
    assert _calls(slurm, "salloc") == []


def test_the_kernels_own_job_is_attached_placed_on_and_never_cancelled(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    cluster = SlurmCluster.attach("", show=lambda line: pytest.fail(f"nothing is queued: {line}"))
    assert (cluster.job_id, cluster.made, cluster.attached) == ("42", False, True)
    assert cluster.info.nodes == ("node1",) and cluster.info.gpus == {"node1": 2}
    nvidia = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    assert cluster.has_cuda is (nvidia >= 2)  # the real probe ran "on" node1: this host's devices
    backend = cluster.place(2, per_host=1, wait=0.0)  # --per-host and --place-timeout: Ray's, not Slurm's
    assert isinstance(backend, SlurmBackend) and [slot.rank for slot in backend.slots] == [0, 1]
    if not cluster.has_cuda:
        assert backend.devices == CLUSTER_CPU  # a GPU GRES without CUDA behind it: the ranks use gloo
    with pytest.raises(LaunchError) as refused:
        cluster.place(3, None, 0.0)
    assert str(refused.value).startswith(
        "taas: --gpus 3 cannot be placed: Slurm job 42 has 2 GPU(s) on its usable nodes (node1); ")
    assert cluster.status_lines() == ["cluster: Slurm job 42 (this kernel's own job), partition gpu, 1 node(s), "
                                      "2 GPU, time left 59:00", "  node1: 2 GPU, 4 CPU, idle"]
    cluster.detach()
    assert not cluster.attached
    cluster.detach()  # idempotent
    assert _calls(slurm, "scancel") == [] and (slurm / "job-42").read_text() == "RUNNING None\n"
    every = (slurm / "calls.log").read_text().splitlines()
    assert every and all(line.endswith("[SLURM_JOB_ID=unset]") for line in every)  # the kernel's job's variables kept out


def test_options_inside_a_job_ask_for_a_new_allocation_shown_while_queued_and_given_back_on_detach(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    shown: list[str] = []

    def show(line: str) -> None:
        shown.append(line)
        (slurm / "grant").touch()  # the controller grants it once the queue was shown

    cluster = SlurmCluster.attach("-p gpu --gpus-per-node 2 -- --exclusive", show)
    assert (cluster.job_id, cluster.made, cluster.attached) == ("77", True, True)
    [salloc] = _calls(slurm, "salloc")
    assert salloc.startswith("salloc --partition=gpu --gpus-per-node=2 --ntasks-per-node=2 --exclusive --no-kill cat")
    assert shown and re.fullmatch(r"taas: Slurm job 77 PENDING \(Resources\), 2 of 2 waiting in gpu, waited 0:\d\d; "
                                  "interrupt the kernel to cancel it", shown[0]), shown
    cluster.detach()  # the keeper's pipe closes: salloc's cat ends and salloc relinquishes the job
    assert not cluster.attached
    assert (slurm / "job-77").read_text() == "COMPLETED None\n"
    assert _calls(slurm, "scancel") == []  # given back by salloc itself, in time


def test_an_interrupt_while_queued_cancels_the_request_and_holds_nothing(slurm, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    keepers_before = set(threading.enumerate())

    def interrupted(line: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(ClusterError) as raised:
        SlurmCluster.attach("--partition gpu", interrupted)
    assert str(raised.value) == "taas: interrupted while the allocation was queued: it was cancelled, nothing is held"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert (slurm / "job-77").read_text() == "CANCELLED None\n"  # revoked by salloc, on the keeper's SIGTERM
    assert [call.split()[-2] for call in _calls(slurm, "scancel")] == ["77"]  # and cancelled by id, to be sure
    alive = [thread for thread in set(threading.enumerate()) - keepers_before if thread.name == "taas-salloc"]
    for thread in alive:
        thread.join(5)
    assert not any(thread.is_alive() for thread in alive)  # salloc's stderr reached its end: salloc is gone


def test_a_request_salloc_refuses_is_one_error_with_salloc_s_reason(slurm, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ClusterError) as raised:
        SlurmCluster.attach("--partition nope", print)
    assert str(raised.value) == ("taas: salloc could not get the allocation: "
                                 "error: Job submit/allocate failed: Invalid partition name specified")
    assert not os.path.exists(slurm / "job-77")
