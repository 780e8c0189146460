"""Collective checkpoints on a Ray cluster whose hosts do or do not see the notebook's repository.

A real Ray cluster on this machine: the head (the notebook's host, no GPU) from
``ray.cluster_utils``, and two worker nodes started with ``ray start --block``, each in a mount
namespace of its own (``unshare --mount``, root) where one folder of this machine is an empty
tmpfs: node A (2 GPUs) has its own ``local-A``, node B (1 GPU) its own ``local-B``. A repository
under ``local-A`` is therefore on the notebook's filesystem and on B's, and not on A's: A is a
host that does not see it, exactly as a node with a disk of its own; the product finds that out by
itself (writes/away.py's marker), nothing in it knows about the test.

``--gpus 2 --per-host 1`` puts one rank on each of A and B. Every test checks the checkpoint
whole in the notebook's repository (its ``.metadata`` against its parts, by the kernel, then read
back in the notebook), rank 0's other file landed and rank 1's not, and nothing left on any host.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.collective_save import assert_resume_fails_where_the_repository_is_not, assert_whole, save, use_repository
from tests.kernel_client import Kernel, away_layers_left, wait_until_gone
from tests.ray.test_cluster import cell_processes

pytestmark = pytest.mark.ray
cluster_utils = pytest.importorskip("ray.cluster_utils", reason='the cluster mode needs Ray: pip install "taas-magic[ray]"')

NODES = {"A": 2, "B": 1}  # a node's name -> its GPUs


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode == 0


def _start_node(address: str, gpus: int, hidden: Path, log: Path) -> subprocess.Popen:
    """A Ray worker node in a mount namespace of its own, where ``hidden`` is an empty tmpfs (its own disk);
    one at a time, started again once if it gives up (Ray waits 30 s for a raylet, not enough on a busy machine)."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
               'mount -t tmpfs -o mode=0755 taas-node-local "$0" && exec "$@"', str(hidden),
               ray, "start", f"--address={address}", "--num-cpus=1", f"--num-gpus={gpus}", "--block", "--disable-usage-stats"]
    for _ in range(2):
        with open(log, "wb") as out:
            node = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        deadline = time.monotonic() + 90
        while node.poll() is None and time.monotonic() < deadline and "Ray runtime started" not in log.read_text():
            time.sleep(0.2)
        if node.poll() is None:
            return node
    raise RuntimeError(f"a Ray node did not start: {log.read_text()[-3000:]}")


def _head(tries: int = 3):
    """The head, the notebook's host (no GPU). Ray gives a starting node 30 s to register, a bound it
    hard-codes (ray/_private/node.py): on a busy machine it can give up while its processes still
    start. Then what it started is stopped (``ray stop --force``: on this machine only the tests run
    Ray) and it is started again."""
    for attempt in range(tries):
        try:
            return cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
        except Exception:  # Ray raises a bare Exception: "The current node timed out during startup"
            if attempt == tries - 1:
                raise
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                           capture_output=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def away_cluster():
    if not _can_unshare():
        pytest.skip("a host of its own filesystem needs root and unshare --mount")
    root = Path(tempfile.mkdtemp(prefix="taas-test-hosts-"))
    cluster = None
    nodes = {}
    try:
        cluster = _head()
        for name, gpus in NODES.items():
            (root / f"local-{name}").mkdir()
            nodes[name] = _start_node(cluster.address, gpus, root / f"local-{name}", root / f"node-{name}.log")
        yield cluster, root, nodes
    finally:
        for node in nodes.values():
            try:
                os.killpg(node.pid, signal.SIGTERM)  # ray start --block, and the node's processes it started
            except ProcessLookupError:
                pass
            node.wait(30)
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel(away_cluster):
    cluster, root, nodes = away_cluster
    kernel = Kernel()
    ran = kernel.execute(f"%taas cluster {cluster.address}", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()
    deadline = time.monotonic() + 120
    while "3 node(s)" not in (status := kernel.execute("%taas status").stream()):
        for name, node in nodes.items():
            assert node.poll() is None, (root / f"node-{name}.log").read_text()
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    yield kernel
    kernel.shutdown()


@pytest.fixture(autouse=True)
def nothing_left_on_any_host(kernel):
    yield
    alive = wait_until_gone(cell_processes(), timeout=15)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    assert not away_layers_left(kernel), "an away host's layers"


def _hosts(ran) -> tuple[str, str]:
    layout = re.search(r"cluster: rank 0 on .+? \(node (\w+)\), rank 1 on .+? \(node (\w+)\)", ran.stream("stdout"))
    assert layout, ran.stream()
    return layout.group(1), layout.group(2)


def test_a_dcp_save_on_two_hosts_that_see_the_repository_is_written_in_place(kernel, tmp_path):
    use_repository(kernel, tmp_path / "repo")
    ran, seen = save(kernel, "--per-host 1 ")
    rank0, rank1 = _hosts(ran)
    assert rank0 != rank1 and seen == {0: True, 1: True}
    assert_whole(kernel, tmp_path / "repo", ran, away=set())


def _until_every_gpu_is_free(kernel: Kernel, patience: float = 60.0) -> None:
    """Until the cluster shows every GPU free: a run's placement group is given back as the cell ends,
    but Ray's free counts catch up a moment later, and the hosts are planned by what is free (a host
    still counted busy is planned after the other, so rank 0 would land elsewhere)."""
    total = sum(NODES.values())
    deadline = time.monotonic() + patience
    while True:
        shown = kernel.execute("%taas cluster").stream()
        if f"{total}/{total} GPU free" in shown or time.monotonic() > deadline:
            assert f"{total}/{total} GPU free" in shown, shown
            return
        time.sleep(0.5)


def test_the_parts_of_ranks_on_hosts_without_the_repository_are_sent_to_it(kernel, away_cluster):
    """Two repositories, each seen by one of the two hosts: rank 0 is away for one of them (its part, the
    .metadata and its own file are sent) and rank 1 for the other (its part is sent)."""
    _, root, nodes = away_cluster
    aways = []
    for name in NODES:
        repo = root / f"local-{name}" / "repo"
        use_repository(kernel, repo)
        _until_every_gpu_is_free(kernel)  # then the placement is the same each time: A (2 free) first, rank 0 there
        ran, seen = save(kernel, "--per-host 1 ")
        away = {rank for rank, sees in seen.items() if not sees}
        assert len(away) == 1, ran.stream()  # the rank on the host whose own folder hides the repository
        assert_whole(kernel, repo, ran, away)
        hidden = subprocess.run(["nsenter", "-t", str(nodes[name].pid), "-m", "ls", "-A", str(root / f"local-{name}")],
                                capture_output=True, text=True)
        assert hidden.returncode == 0 and hidden.stdout == "", hidden  # nothing written on that host's own folder
        aways.append(away)
    assert sorted(rank for away in aways for rank in away) == [0, 1], aways  # rank 0 off the notebook's host, and not


RESUME = """\
#pragma taas --gpus 2 --per-host 1 --hang 1 --timeout 20
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    torch.save({"step": 3}, "resume.pt")
dist.barrier()
t = torch.zeros(1)
if os.path.exists("resume.pt"):  # resume: rank 0 sees what it wrote
    dist.barrier()
else:  # a host that does not see the repository: starts from scratch, and waits for what never comes
    dist.recv(t, src=0)
"""


def test_a_resume_on_a_host_that_does_not_see_the_repository_is_said_while_the_ranks_wait(kernel, away_cluster):
    """Rank 1 runs where the repository is not: rank 0's checkpoint is not there, the ranks take different
    branches, and the hang line says so within seconds, naming the host's blindness; --timeout then ends it."""
    _, root, _ = away_cluster
    use_repository(kernel, root / "local-B" / "repo-resume")
    _until_every_gpu_is_free(kernel)  # rank 0 on A (which sees it), rank 1 on B (which does not)
    ran = kernel.execute(RESUME, timeout=120)
    assert ran.error is not None and ran.error["ename"] == "RunTimeout", ran.stream()
    said = [line for line in ran.stream().splitlines() if line.startswith("taas: ranks disagree for ")]
    assert len(said) == 1, ran.stream()
    assert said[0].endswith("rank 0 waits in barrier (line 9); rank 1 waits in recv (line 11) (rank 1 runs on a host "
                            "that does not see the repository: what rank 0 wrote is not there)"), said


@pytest.mark.parametrize("keep", [False, True], ids=["fresh", "kept"])
def test_a_resume_in_a_later_cell_on_a_host_that_does_not_see_the_repository_fails_with_one_line(kernel, away_cluster,
                                                                                                  keep):
    """writes/unseen.py: rank 0 (host A sees the repository) saves; in the next cell rank 1 (host B does not) finds
    the file's name as rank 0 does and fails reading it, naming the file and why, rather than starting afresh."""
    _, root, _ = away_cluster
    use_repository(kernel, root / "local-B" / f"repo-later-{keep}")
    _until_every_gpu_is_free(kernel)  # rank 0 on A, rank 1 on B
    try:
        assert_resume_fails_where_the_repository_is_not(kernel, "--per-host 1" + (" --keep" if keep else ""), away=1,
                                                        placed=(lambda: None) if keep else lambda: _until_every_gpu_is_free(kernel))
    finally:
        kernel.execute("%taas release")
