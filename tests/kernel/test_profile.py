"""``--profile [N]`` over a real kernel: a DDP cell on gloo, its merged trace holding both ranks, the breakdown in
the cell; a cell with no step marks profiled whole; kept ranks profiled cell after cell, and clean after."""

import os
import re
import stat
import warnings

import pytest

from tests.kernel_client import Kernel
from tests.profiled import (
    DDP,
    LOCAL,
    a_profiled_ddp_cell_merges_every_rank,
    kept_ranks_are_profiled_cell_after_cell,
    ranks_in,
    saved,
    trace_of,
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernel of its own, started in a folder of its own: the notebook's folder, where the traces land."""
    folder = tmp_path_factory.mktemp("notebook")
    own = Kernel(cwd=str(folder))
    own.folder = str(folder)
    yield own
    own.shutdown()


def test_a_ddp_cell_merged_with_both_ranks_and_its_breakdown(kernel):
    path, _ = a_profiled_ddp_cell_merges_every_rank(kernel)
    assert os.path.dirname(os.path.dirname(os.path.dirname(path))) == kernel.folder  # the notebook's folder
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert trace_of(path)["taas"]["clocks"] == "one host: one clock"


def test_the_slow_rank_is_named_under_the_breakdown_and_the_fast_one_never(kernel):
    slowed = DDP.replace("    optimizer.step()\n", "    optimizer.step()\n    time.sleep(0.05 * dist.get_rank())\n")
    # the cell's own global step hook beside taas's: the window's end once removed a hook while torch ran them
    slowed = slowed.replace("for step", "from torch.optim.optimizer import register_optimizer_step_post_hook\n"
                            "register_optimizer_step_post_hook(lambda *_: None)\nfor step")
    ran = kernel.execute(slowed.format(head=LOCAL).replace("import torch,", "import time, torch,"))
    assert ran.reply["status"] == "ok", ran.error_text()
    assert re.search(r"\n  rank 1 is [\d.]+x slower than the others; they wait \d+% of each step for it\n", ran.stream())
    assert "rank 0 is" not in ran.stream()


def test_a_cell_without_step_marks_is_profiled_whole(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --profile\nimport torch\n"
                         "x = torch.randn(200, 200) @ torch.randn(200, 200)\n")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "--profile: the whole cell" in ran.stream()
    assert ranks_in(saved(ran)) == {0: "rank 0", 1: "rank 1"}


def test_kept_ranks_profiled_cell_after_cell_and_clean_after(kernel):
    kept_ranks_are_profiled_cell_after_cell(kernel)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_holistic_trace_analysis_reads_the_runs_rank_files(kernel):
    """HTA (the [test] extra) loads the saved folder of per-rank traces; its analyses beyond loading need GPU kernels."""
    trace_analysis = pytest.importorskip("hta.trace_analysis")
    pandas_errors = pytest.importorskip("pandas.errors")
    path, _ = a_profiled_ddp_cell_merges_every_rank(kernel)
    with warnings.catch_warnings():  # HTA 0.5.0 calls reset_index(inplace=True), which pandas 3.1 deprecates
        warnings.simplefilter("ignore", getattr(pandas_errors, "Pandas4Warning", DeprecationWarning))
        analysis = trace_analysis.TraceAnalysis(trace_dir=os.path.join(os.path.dirname(path), "ranks"))
    assert sorted(analysis.t.traces) == [0, 1]
    assert all(len(analysis.t.get_trace(rank)) > 0 for rank in (0, 1))
