"""One cell through a real kernel, timed: its reply, its first line, its interrupt; the cells the kept-ranks benches
run, and the row they print.

Runs in the benches' own process (bench/keep.py, bench/othertools.py, bench/versions.py, bench/repoview.py), over
tests/kernel_client.py's jupyter_client kernel.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable

from tests.kernel_client import Kernel

KEEP = "#pragma taas --gpus 2 --device cpu --keep\n"

FRESH = "#pragma taas --gpus 2 --device cpu\n"

FIRST = "print('first-line', flush=True)\n"

ALL_REDUCE = ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
              "dist.all_reduce(torch.ones(1))\ndist.destroy_process_group()\n")

FAILING = ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
           "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 gave up')\ndist.all_reduce(torch.ones(1))\n")

MAKE_GROUP = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"

# the same on a group made already: in jupyter-distributed's kernels a second init_process_group raises on every rank
# ("trying to initialize the default process group twice"), which fails the cell before any collective
FAILING_MADE = FAILING.replace("dist.init_process_group('gloo')\n", "")

LOOP = "import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.01)\n"



def reply(kernel: Kernel, code: str, expect: str = "ok") -> float:
    msg_id, started = kernel.submit(code)
    ran = kernel.collect(msg_id, started, timeout=300)
    if ran.reply["status"] != expect:
        raise RuntimeError(f"expected {expect}: {ran.error_text() or ran.stream()}")
    return ran.reply_at



def wait_shown(kernel: Kernel, msg_id: str, text: str, arrived: Callable[[str, dict], bool] | None = None) -> None:
    """Until ``text`` shows on iopub: in a stream, or where ``arrived(kind, content)`` says (another tool's display)."""
    if arrived is None:
        kernel.wait_for_stream(msg_id, text, timeout=120)
    else:
        kernel.wait_for(msg_id, arrived, text, timeout=120)



def first_line(kernel: Kernel, code: str, arrived: Callable[[str, dict], bool] | None = None) -> float:
    """The request -> ``first-line`` on iopub: in a stream, or where ``arrived(kind, content)`` says (a display)."""
    msg_id, started = kernel.submit(code)
    wait_shown(kernel, msg_id, "first-line", arrived)
    seconds = time.monotonic() - started
    kernel.collect(msg_id, started, timeout=120)
    return seconds



def in_display(text: str) -> Callable[[str, dict], bool]:
    """Whether ``text`` arrived in another tool's rank display (anything on iopub but the code echoed)."""
    return lambda kind, content: kind != "execute_input" and text in json.dumps(content)



def interrupt(kernel: Kernel, code: str, arrived: Callable[[str, dict], bool] | None = None) -> tuple[float, str]:
    """A cell looping in Python, once ``looping`` is shown (in a stream, or where ``arrived`` says): the kernel's
    interrupt -> its reply; and what the cell printed."""
    msg_id, started = kernel.submit(code)
    wait_shown(kernel, msg_id, "looping", arrived)
    asked = time.monotonic()
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, started, timeout=120)
    return time.monotonic() - asked, ran.stream()



def row(name: str, values: list[float], beside: list[float] | None, target: str, unit: str = "s") -> str:
    def shown(samples: list[float]) -> str:
        return f"{statistics.median(samples):.3f} {unit} ({min(samples):.3f}-{max(samples):.3f})"

    other = shown(beside) if beside else ""
    return f"| {name} | {shown(values)} | {other} | {target} |"

