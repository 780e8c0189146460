"""A compiled cell run again in fresh ranks compiles from the session's compile cache (compilecache/):
the second run's ranks, warm spares forked from a factory that warmed torch's compiler once the session
compiled (launch/local/factories.py), find in the session's owner-only folder what the first run
compiled; ranks whose person pointed Inductor at an empty folder of their own find it there too,
from the portable artifacts the first run saved; and the folder goes when the extension unloads."""

import os
import stat
import time

COMPILED = """\
#pragma taas --device cpu --gpus 2 --output all
import os, sys
spare = "torch" in sys.modules  # a warm spare imported torch before it became this rank
warmed = "torch._inductor.compile_fx" in sys.modules  # ...and a compiler factory's, Inductor
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
torch.compile(model)(torch.randn(4, 8)).sum().backward()
hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
print("compiled", os.environ["RANK"], spare, cache_dir(), hits, warmed, flush=True)
"""


def _ranks(ran) -> dict[str, tuple[bool, str, int, bool]]:
    """Each rank's line: (started from a spare, Inductor's cache folder, cache hits, the compiler imported before)."""
    found = {}
    for line in ran.stream("stdout").splitlines():
        if "compiled " in line:  # "[rank K] compiled K ..."
            _, rank, spare, folder, hits, warmed = line[line.index("compiled "):].split()
            found[rank] = (spare == "True", folder, int(hits), warmed == "True")
    assert set(found) == {"0", "1"}, ran.stream() + ran.error_text()
    return found


def _until_the_compiler_is_warmed(kernel, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while "compiler warmed" not in (status := kernel.execute("%taas status").stream()):
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def test_a_compiled_cell_run_again_compiles_from_the_sessions_cache(new_kernel, tmp_path):
    kernel = new_kernel()
    first = kernel.execute(COMPILED, timeout=900)
    assert first.reply["status"] == "ok", first.error_text()
    cold = _ranks(first)
    inductor = cold["0"][1]
    session = os.path.dirname(inductor)
    assert os.path.basename(inductor) == "inductor" and {folder for _, folder, _, _ in cold.values()} == {inductor}
    assert os.path.basename(session).startswith(f"taas-compile-{kernel.pid}-")
    assert stat.S_IMODE(os.stat(session).st_mode) == 0o700  # owner-only: no other user plants what a rank loads
    assert all(hits == 0 for _, _, hits, _ in cold.values())  # a new session's folder: truly cold
    assert sorted(os.listdir(os.path.join(session, "artifacts"))) == ["rank-0.bin", "rank-1.bin"]
    assert not any(warmed for *_, warmed in cold.values())  # the session had not compiled: plain spares
    _until_the_compiler_is_warmed(kernel)  # a person's pause: the spares' factory warms torch's compiler

    again = kernel.execute(COMPILED, timeout=900)
    assert again.reply["status"] == "ok", again.error_text()
    warm = _ranks(again)
    assert all(spare for spare, _, _, _ in warm.values())  # spares, whose torch was imported before the launch...
    assert {folder for _, folder, _, _ in warm.values()} == {inductor}  # ...use the session's folder all the same
    assert all(hits > 0 for _, _, hits, _ in warm.values()), warm  # served from the cache, not compiled again
    assert all(warmed for *_, warmed in warm.values()), warm  # forks of the factory that imported the compiler
    assert "compile cache could not be" not in again.stream()  # rank K's saved artifacts loaded without a word

    mine = tmp_path / "mine"  # the person's own, empty: only the artifacts (artifacts.py) can fill it
    kernel.execute(f"import os\nos.environ['TORCHINDUCTOR_CACHE_DIR'] = {str(mine)!r}")
    theirs = kernel.execute(COMPILED, timeout=900)
    assert theirs.reply["status"] == "ok", theirs.error_text()
    loaded = _ranks(theirs)
    assert {folder for _, folder, _, _ in loaded.values()} == {str(mine)}  # their variable won...
    assert all(hits > 0 for _, _, hits, _ in loaded.values()), loaded  # ...and rank K's artifacts filled it
    assert "compile cache could not be" not in theirs.stream()

    ran = kernel.execute("%unload_ext taas_magic")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert not os.path.exists(session)
