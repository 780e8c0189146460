"""The Slurm engine's pure parts: the options %taas cluster slurm reads, scontrol's job text, the
step's channel numbering, a rank's environment from its task's, and how a lost node is named.
(The engine itself runs on a real Slurm in tests/slurm.)"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from taas_magic.errors import ClusterError
from taas_magic.launch.hosts.outputhub import HostControl
from taas_magic.launch.slurm import slurmcli
from taas_magic.launch.slurm.allocation import AllocationRequest
from taas_magic.launch.slurm.backend import _spans
from taas_magic.launch.slurm.step import SlurmChild, StepTarget, fewest_nodes
from taas_magic.launch.slurm.task import rank_env
from taas_magic.launch.slurm.taskcommands import TaskCommands
from taas_magic.peers import StepChannels

JOB_TEXT = """\
JobId=42 JobName=interactive
   UserId=ada(1000) GroupId=ada(1000) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   RunTime=00:00:01 TimeLimit=01:00:00 TimeMin=N/A
   Partition=gpu AllocNode:Sid=login1:21734
   NodeList=gpu[1-2],cpu7
   NumNodes=3 NumCPUs=10 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   JOB_GRES=gpu:a100:4
     Nodes=gpu[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:a100:2(IDX:0-1)
     Nodes=cpu7 CPU_IDs=0,2 Mem=0 GRES=
   MinCPUsNode=2 MinMemoryNode=0 MinTmpDiskNode=0
"""


def expand(nodelist: str) -> list[str]:
    return {"gpu[1-2],cpu7": ["gpu1", "gpu2", "cpu7"], "gpu[1-2]": ["gpu1", "gpu2"], "cpu7": ["cpu7"]}[nodelist]


def test_a_job_is_read_with_each_nodes_gpus_and_cpus():
    job = slurmcli.parse_job("42", JOB_TEXT, expand)
    assert job.state == "RUNNING" and job.partition == "gpu" and job.time_limit == "01:00:00"
    assert job.nodes == ("gpu1", "gpu2", "cpu7")
    assert job.gpus == {"gpu1": 2, "gpu2": 2, "cpu7": 0} and job.gpus_total == 4
    assert job.cpus == {"gpu1": 4, "gpu2": 4, "cpu7": 2}


def test_the_options_people_pass_to_salloc_by_name_and_the_rest_through():
    request = AllocationRequest.parse("-p gpu --account lab --time 2:00:00 --gpus-per-node 4 -N 2 --mem=64G -- --exclusive")
    assert (request.partition, request.account, request.time, request.gpus_per_node, request.nodes) == \
        ("gpu", "lab", "2:00:00", "4", "2")
    assert request.extra == ("--mem=64G", "--exclusive")
    args = request.salloc_args()
    assert "--partition=gpu" in args and "--gpus-per-node=4" in args and "--ntasks-per-node=4" in args
    assert args[-2:] == ["--mem=64G", "--exclusive"]
    assert AllocationRequest.parse("").empty and not request.empty
    assert "--ntasks-per-node=4" not in AllocationRequest.parse("--gpus-per-node 4 --ntasks-per-node=1").salloc_args()[:-1]


def test_unreadable_options_are_one_clear_error():
    with pytest.raises(ClusterError, match="cannot read the Slurm options"):
        AllocationRequest.parse("--constraint 'a100")


def test_every_channel_of_a_step_has_its_own_number():
    channels = StepChannels(3)
    numbers = [channels.stream(rank, stream) for rank in range(3) for stream in ("stdout", "stderr")]
    numbers += [channels.exits(task) for task in range(3)] + [channels.command(task) for task in range(3)]
    assert sorted(numbers) == list(range(len(channels)))


def test_a_rank_sees_its_tasks_slurm_variables_not_the_kernels(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu2")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    planned = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "3", "HOME": "/home/ada", "OMP_NUM_THREADS": "64"}
    env = rank_env(planned, "2,3", None)
    assert env["SLURM_PROCID"] == "3" and env["SLURMD_NODENAME"] == "gpu2" and env["RANK"] == "3"
    assert "SLURM_NTASKS" not in env  # the kernel's own job's value never leaks in
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["HOME"] == "/home/ada"
    assert env["OMP_NUM_THREADS"] == "1"  # the CPUs Slurm gave the task, not the kernel host's
    assert rank_env(planned, None, "8")["OMP_NUM_THREADS"] == "8"  # the person's own setting wins
    assert "CUDA_VISIBLE_DEVICES" not in rank_env({}, None, None) or os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_rank_whose_task_vanished_names_its_node_as_lost():
    ours, theirs = socket.socketpair()
    child = SlurmChild(3, "gpu2", -1, -1, HostControl(ours, "gpu2"), lambda: None, lambda: "task 3: gone")
    assert child.poll() is None and child.host == "gpu2"
    theirs.close()  # the node went away: no exit code came
    assert child.poll() == -9
    assert child.host.startswith("gpu2 (its task ended without reporting the rank's exit") and "srun said: task 3: gone" in child.host
    ours.close()
    ours, theirs = socket.socketpair()
    killed = SlurmChild(1, "gpu1", -1, -1, HostControl(ours, "gpu1"), lambda: None, lambda: "nothing")
    theirs.sendall(b"0 -9\n")  # the task reported its rank killed (out of memory, say): the node is fine
    theirs.close()
    assert killed.poll() == -9 and killed.host == "gpu1"
    ours.close()


def test_a_rank_whose_step_ended_without_its_exit_counts_as_killed():
    ours, theirs = socket.socketpair()  # a node that lost power: its channel never closes
    ended = [None]
    child = SlurmChild(0, "gpu1", -1, -1, HostControl(ours, "gpu1"), lambda: ended[0], lambda: "nothing")
    assert child.poll() is None
    ended[0] = 0.5  # srun just ended: its last exit reports may still be on the way
    assert child.poll() is None
    ended[0] = 5.0
    assert child.poll() == -9
    ours.close()
    theirs.close()


def test_the_ranks_step_packs_its_tasks_on_the_fewest_nodes():
    assert fewest_nodes([2, 2, 2], 4) == 2 and fewest_nodes([4, 4], 2) == 1 and fewest_nodes([1, 4, 2], 5) == 2
    assert fewest_nodes([2, 2], 5) is None
    target = StepTarget("7", "10.0.0.1", True, 2, 8, ("gpu3",))
    command = target.srun(4)
    assert "--nodes=2" in command and "--gpus-per-task=1" in command and "--cpus-per-task=8" in command
    assert "--exclude=gpu3" in command and "--overlap" not in command  # ranks' steps never share GPUs
    workers = StepTarget("7", "10.0.0.1", False).srun(2)
    assert "--overlap" in workers and "--gres=none" in workers


def test_a_late_answer_is_not_read_as_the_next_commands():
    ours, theirs = socket.socketpair()
    commands = TaskCommands()
    commands.add(0, ours)
    assert commands.ask([0], {"do": "stacks"}, patience=0.05) == {}  # it answers too late
    theirs.sendall(b'{"number": 1, "stacks": {}}\n{"number": 2, "sig')  # the late answer, and half of the next
    threading.Timer(0.1, lambda: theirs.sendall(b'nals": ["SIGINT"]}\n')).start()
    assert commands.ask([0], {"do": "stop"}, patience=5) == {0: {"number": 2, "signals": ["SIGINT"]}}
    theirs.close()
    assert commands.ask([0], {"do": "end"}, patience=5) == {} and commands.silent == {0}
    ours.close()


def test_spans_say_which_processes_run_where():
    assert _spans(["n1", "n1", "n2"], "worker") == "workers 0-1 on n1, worker 2 on n2"
