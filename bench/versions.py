"""This checkout against another tree of taas_magic (an earlier commit), on the kept-cell rows of bench/keep.py.

    git worktree add /tmp/before REV
    python bench/versions.py /tmp/before [--rounds 10] [--cells 15]

Through real kernels (jupyter_client), ``--device cpu --gpus 2`` (gloo), kept ranks: each round starts a fresh
kernel importing taas_magic from one tree (``PYTHONPATH`` and the working directory: its ranks and spares too),
measures ``--cells`` kept first lines (the request -> ``first-line`` on iopub) and ``--cells`` replies of a kept
cell that all-reduces one tensor, each after 0.5 s idle, then ends it; the two trees take turns, the order
swapped each round (ABBA). Each round's medians are paired: the table gives the median of the rounds' ratios
(this checkout / the other), its 95% interval (bench/intervals.py) and its range. One kernel at a time: two
kernels side by side showed a ~1.3x effect of which one started second, larger than any change it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cells import ALL_REDUCE, FIRST, KEEP, first_line, reply  # noqa: E402
from bench.intervals import median_interval  # noqa: E402
from tests.kernel_client import Kernel  # noqa: E402


def one_round(tree: str, cells: int) -> tuple[float, float]:
    """A fresh kernel on ``tree``: the median kept first line and the median kept all_reduce reply."""
    kernel = Kernel(cwd=tree, env={"PYTHONPATH": tree})
    try:
        reply(kernel, KEEP + ALL_REDUCE)  # the kept ranks started, their group made once
        reply(kernel, KEEP + FIRST)
        firsts, reduces = [], []
        for _ in range(cells):
            time.sleep(0.5)
            firsts.append(first_line(kernel, KEEP + FIRST))
            time.sleep(0.5)
            reduces.append(reply(kernel, KEEP + ALL_REDUCE))
        return statistics.median(firsts), statistics.median(reduces)
    finally:
        kernel.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", help="the other tree: a checkout (a git worktree) of taas_magic")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cells", type=int, default=15)
    arguments = parser.parse_args()
    trees = {"this": str(ROOT), "other": str(Path(arguments.other).resolve())}
    medians: dict[str, dict[str, list[float]]] = {name: {"first": [], "reduce": []} for name in trees}
    for turn in range(arguments.rounds):
        for name in ("other", "this") if turn % 2 == 0 else ("this", "other"):
            first, reduce = one_round(trees[name], arguments.cells)
            medians[name]["first"].append(first)
            medians[name]["reduce"].append(reduce)
    print(f"this checkout / {trees['other']}, {arguments.rounds} rounds of {arguments.cells} kept cells each, one fresh "
          "kernel a round (ABBA): the median of the rounds' ratios, its 95% interval, its range; each tree's median\n\n"
          "| row | this / other | 95% interval | range | this | other |\n" + "| --- " * 6 + "|")
    for key, title in (("first", "kept first line"), ("reduce", "kept cell with an all_reduce, to its reply")):
        ours, theirs = medians["this"][key], medians["other"][key]
        ratios = [mine / other for mine, other in zip(ours, theirs)]
        low, high = median_interval(ratios)
        print(f"| {title} | {statistics.median(ratios):.3f}x | {low:.3f}-{high:.3f}x | {min(ratios):.2f}-{max(ratios):.2f}x "
              f"| {statistics.median(ours) * 1000:.2f} ms | {statistics.median(theirs) * 1000:.2f} ms |")


if __name__ == "__main__":
    main()
