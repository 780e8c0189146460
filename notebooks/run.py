"""Run a notebook headless in a real kernel, printing each cell's output as it streams.

    python notebooks/run.py notebooks/quickstart.ipynb [--kernel python3] [--cwd DIR]

Every code cell runs in order in one kernel; stream output is printed the moment it
arrives on iopub, rich output as its mime types. The first failing cell stops the run
with exit status 1.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
import uuid

import nbformat
from jupyter_client.manager import KernelManager
from jupyter_core.paths import jupyter_runtime_dir


def run_notebook(path: str, kernel_name: str, cwd: str) -> int:
    notebook = nbformat.read(path, as_version=4)
    # IPC transport (Unix sockets in the owner-only runtime directory): a kernel on TCP without
    # CurveZMQ keys starts by warning that its traffic is plain text, which this one-machine run
    # did not ask for; IPC is local by construction and every ipykernel and jupyter_client serves it.
    runtime = jupyter_runtime_dir()
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    sockets = os.path.join(runtime, f"kernel-{uuid.uuid4()}")  # absolute: the kernel runs in the notebook's folder
    manager = KernelManager(kernel_name=kernel_name, transport="ipc", ip=sockets)
    manager.start_kernel(cwd=cwd)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        cells = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
        for number, source in enumerate(cells, start=1):
            print(f"\n=== cell {number} ===", flush=True)
            started = time.monotonic()
            msg_id = client.execute(source)
            failed = False
            while True:
                try:
                    msg = client.get_iopub_msg(timeout=5)
                except queue.Empty:
                    if not manager.is_alive():  # it died (its output has ended): say so rather than wait
                        print(f"\nthe kernel died during cell {number}", file=sys.stderr, flush=True)
                        return 1
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    (sys.stdout if content["name"] == "stdout" else sys.stderr).write(content["text"])
                    sys.stdout.flush()
                elif kind in ("display_data", "execute_result"):
                    text = content["data"].get("text/plain", "")
                    print(f"[{kind}: {', '.join(sorted(content['data']))}] {text}", flush=True)
                elif kind == "error":
                    print("\n".join(content["traceback"]), file=sys.stderr, flush=True)
                    failed = True
                elif kind == "status" and content["execution_state"] == "idle":
                    break
            print(f"--- cell {number} took {time.monotonic() - started:.1f} s", flush=True)
            if failed:
                return 1
        return 0
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--cwd", default=None, help="the kernel's working directory (default: the notebook's)")
    args = parser.parse_args()
    cwd = args.cwd or os.path.dirname(os.path.abspath(args.notebook))
    sys.exit(run_notebook(args.notebook, args.kernel, cwd))


if __name__ == "__main__":
    main()
