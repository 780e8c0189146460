"""What every rank of a run receives before its closure: one frozen value, read by attribute,
and the plan of each registered loader it reads (the arithmetic of its passes: feed/plan.py).

Runs wherever it is imported (frozen values): built in the kernel, in a run's plan step
(kernel/runs/run.py), and read in each rank and data worker.

The kernel builds it (kernel/runs/run.py) and sends it pickled in the authenticated ``spec``
frame; the rank (rank/main.py) reads ``spec.source``, ``spec.device``, ... This module
imports nothing, so a rank pays nothing to unpickle it.

Run data reaches a rank here and nowhere else: where its stacks file is (the hang
autopsy), its checkpoint folder and how many to keep, the run's seed. The environment
carries only what a person's code reads (torchrun's variables, ``TAAS_OWNER``) and what a
process needs before it has a channel to read the spec on (the write rule, a data
worker's identity: rank/startup.py).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

MAP = "map"
ITERABLE = "iterable"


@dataclass(frozen=True)
class FeedPlan:
    feed: int  # the loader's id in this run
    name: str  # the notebook's name for it, for messages
    kind: str  # MAP or ITERABLE
    pass_length: int | None  # L, elements per pass of the loader (None: unknown)
    units: int  # K
    ranks: int  # N
    workers: int  # M
    shuffle: bool  # replayed passes get a new order each time
    seed: int
    ahead: int  # elements per rank that may wait before workers pause

    # -- map-style arithmetic (L known): fresh passes are fixed in advance --------------
    @property
    def fresh_passes(self) -> int:
        """F, the number of fresh passes of a map-style feed."""
        assert self.pass_length is not None
        return -(-self.units // self.pass_length)

    def fresh_length(self, fresh_pass: int) -> int:
        """Elements of fresh pass p that are delivered (a multiple of N)."""
        assert self.pass_length is not None
        extracted = min(self.pass_length, self.units - fresh_pass * self.pass_length)
        return delivered_length(extracted, self.ranks)

    def stream_offset(self, fresh_pass: int) -> int:
        """Position of fresh pass p's first element among all delivered fresh elements."""
        return fresh_pass * self.fresh_length(0)

    def total_delivered(self) -> int:
        passes = self.fresh_passes
        return self.stream_offset(passes - 1) + self.fresh_length(passes - 1)

    def replay_order(self, pass_no: int, length: int) -> list[int] | None:
        """The order replayed pass ``pass_no`` gives the ``length`` elements of the fresh pass it replays (element
        ``j`` of the replay is ``order[j]`` of that pass), or None: the fresh pass's own order (a loader that does not
        shuffle). Drawn from ``seed * 1_000_003 + pass_no`` alone, so every rank and the exported job draw the same."""
        if not self.shuffle:
            return None
        torch = sys.modules.get("torch")
        if torch is not None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + pass_no)
            return torch.randperm(length, generator=generator).tolist()
        order = list(range(length))
        random.Random(self.seed * 1_000_003 + pass_no).shuffle(order)
        return order

    def describe(self) -> str:
        length = "no len" if self.pass_length is None else f"{self.pass_length} per pass"
        units = f"--units {self.units}"
        if self.pass_length:
            passes = self.units / self.pass_length
            units += f" = {passes:g} pass" + ("" if passes == 1 else "es")
        order = ", shuffled" if self.shuffle else ""
        return f"{self.name} ({self.kind}, {length}{order}, {units})"


def delivered_length(extracted: int, ranks: int) -> int:
    return extracted // ranks * ranks


@dataclass(frozen=True)
class RankFeed:
    """One registered loader as a rank receives it: its plan, and the loader itself pickled (read lazily)."""

    plan: FeedPlan
    original: bytes  # cloudpickle of the notebook's loader, for its attributes (len, dataset, batch_size)


@dataclass(frozen=True)
class PanelPlan:
    """JupyterLab's debugger panel is on (debugger/): what a rank needs to stop before the cell's first line."""

    path: str  # the file the panel knows this cell by (ipykernel's cell file): its breakpoints are the cell's
    breakpoints: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (file, lines) of every breakpoint the panel set


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    sys_path: tuple[str, ...]  # the kernel's, at launch
    source: str  # the cell as plain Python, the person's line numbers kept (cellcode.py)
    display_source: str  # the cell as the person wrote it, for tracebacks
    filename: str  # "<taas In[n]>"
    device: str  # "cuda" (bind LOCAL_RANK's GPU) or "cpu" (nccl served by gloo)
    output: str  # "rank0" or "all": whether a rank other than 0 forwards rich output
    suppress_final: bool  # the cell ends with ";"
    kernel_pid: int  # names the memory files, so a killed kernel's are swept
    result_file_bytes: int  # rank 0's results go through a memory file from this size
    cuda_ipc: bool = False  # CUDA tensors cross by CUDA IPC, both ways (same host, kernel CUDA ready: transfer/cudaipc.py)
    feeds: tuple[RankFeed, ...] = ()  # the registered loaders the cell uses (kernel/supervision/dataplane.py rank_feeds)
    cells: dict[str, tuple[int, list[str]]] = field(default_factory=dict)  # earlier cells' lines (cellcode.py)
    stacks_dir: str = ""  # where rank k arms its hang autopsy: autopsy/dump.py stack_file (empty: no autopsy)
    checkpoints: str = ""  # this run's checkpoint folder (writes/checkpoints.py; empty: taas.save_checkpoint has none)
    keep_checkpoints: int = 2  # the newest kept in it
    trial: int | None = None  # the search's trial number this run is (kernel/trials/searchrun.py); None: not a trial
    post_mortem: bool = False  # IPython's %pdb on: a rank that raises opens a prompt at its failing frame first
    gather_bytes: int = 0  # sharded names come back whole up to this many bytes, then as handles (transfer/sharded.py); 0: no cap
    gather_why: str = ""  # where that limit comes from, for the line that says a name became a handle
    shared: tuple[str, ...] = ()  # --shared: folders every rank writes in place (absolute; writes/savers.py)
    compile_cache: str = ""  # the session's compile cache folder (compilecache/): rank K's artifacts there; empty: off
    profile: int = 0  # --profile N: each rank records N steps after the first and sends its trace (profiling/); 0: off
    seed: int = 0  # the run's seed: the data workers' (kernel/supervision/dataplane.py), rank k's WorkerInfo seed + k
    keep: bool = False  # --keep: after the cell the rank says CellDone and waits for the next (kernel/runs/rankset.py)
    lazy_bytes: int = 0  # kept cells: rank 0's bound names this large stay on the ranks until touched (returns.py); 0: off
    panel: PanelPlan | None = None  # the debugger panel is on: each rank traces its cell (debugger/); None: no tracer
    repository_names: tuple[tuple[str, int], ...] = ()  # a cluster run's repository files (path, size) as the cell starts,
    # for ranks on hosts that do not see it: each one they lack is named there, not readable (writes/unseen.py)
