"""What every rank of a run receives before its closure: one frozen value, read by attribute.

The kernel builds it (magics.py) and sends it pickled in the authenticated ``spec``
frame; the rank (rank/main.py) reads ``spec.source``, ``spec.device``, ... This module
imports nothing, so a rank pays nothing to unpickle it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    feeds: tuple[Any, ...] = ()  # the registered loaders the cell uses (feed/run.py rank_feeds)
    cells: dict[str, tuple[int, list[str]]] = field(default_factory=dict)  # earlier cells' lines (cellcode.py)
