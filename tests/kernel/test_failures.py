"""Every failure path: one clear message, every rank stopped, nothing left, kernel usable."""

import os
import signal
import socket
import time

import psutil
import pytest

from taas_magic import wire
from tests.kernel_client import wait_until_gone, warm_up

# Rank 1 fails while rank 0 would sleep for a minute; the rank 0 sleep proves the stop.
FAILING_RANK_1 = """\
#pragma taas --device cpu --gpus 2 --output all
import os, sys, time, signal
print(f"rank {{os.environ['RANK']}} working", flush=True)
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    {failure}
time.sleep(60)
"""


def _assert_usable(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nok_after = 1\nok_after + 1")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.result["text/plain"] == "2"


@pytest.mark.minimums
@pytest.mark.parametrize(
    ("failure", "summary"),
    [
        ("raise ValueError('bad batch')", "rank 1 on localhost raised ValueError: bad batch"),
        ("sys.exit(1)", "rank 1 on localhost called sys.exit(1)"),
        ("os._exit(3)", "rank 1 on localhost exited with code 3 without reporting an error"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "rank 1 on localhost was killed by SIGKILL"),
    ],
)
def test_a_failing_rank_stops_every_rank(kernel, failure, summary):
    msg_id, started = kernel.submit(FAILING_RANK_1.format(failure=failure))
    kernel.wait_for_stream(msg_id, "[rank 1] rank 1 working")
    working = time.monotonic()
    ran = kernel.collect(msg_id, started)
    assert ran.reply["status"] == "error"
    assert ran.error["ename"] == "RankFailed"
    text = ran.error_text()
    assert summary in text, text
    assert "every rank was stopped" in text
    assert "rank 1 working" in text  # its last lines of output
    # 0.5 s until the failure, then every rank stopped within 5 s (never rank 0's 60 s sleep)
    assert time.monotonic() - working < 0.5 + 5
    _assert_usable(kernel)


@pytest.mark.minimums
def test_traceback_points_at_the_cells_own_lines(kernel):
    ran = kernel.execute(
        """#!g1.1
#pragma taas --device cpu --gpus 2
def inner(v):
    return 10 / v

values = [1, 0]
result = inner(values[int(__import__('os').environ['RANK'])])
"""
    )
    text = ran.error_text()
    assert "rank 1 on localhost raised ZeroDivisionError" in text
    assert 'In[' in text and "line 7, in <module>" in text and "line 4, in inner" in text
    assert "result = inner(values[" in text and "return 10 / v" in text
    assert "taas_magic" not in text  # our frames are stripped


def test_timeout_names_the_ranks_still_running(kernel):
    warm_up(kernel)  # rank 1 has ended well within the 4 s, however loaded the machine
    started = time.monotonic()
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2 --timeout 4\nimport os, time\nif os.environ['RANK'] == '0':\n    time.sleep(60)"
    )
    assert ran.error["ename"] == "RunTimeout"
    assert "--timeout 4s; ranks still running: 0." in ran.error_text()
    assert time.monotonic() - started < 12
    _assert_usable(kernel)


@pytest.mark.minimums
def test_interrupt_stops_every_rank(kernel):
    msg_id, started = kernel.submit(
        "#pragma taas --device cpu --gpus 2 --output all\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)"
    )
    kernel.wait_for_stream(msg_id, ("[rank 0] sleeping", "[rank 1] sleeping"))  # both run (a spare may adopt late)
    ranks = kernel.children()
    assert len(ranks) >= 2
    interrupted = time.monotonic()
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, started)
    assert ran.error["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - interrupted < 5
    assert not wait_until_gone(ranks, timeout=30)
    _assert_usable(kernel)


FINALLY_ON_INTERRUPT = ("#pragma taas --device cpu --gpus 2 --output all\nimport os, time\ntry:\n"
                        "    print('sleeping', flush=True)\n    time.sleep(60)\nfinally:\n"
                        "    try:\n        time.sleep(0.5)\n        said = 'finally ran'\n"
                        "    except KeyboardInterrupt:\n        said = 'finally cut short'\n"
                        "    open(os.path.join({folder!r}, 'rank' + os.environ['RANK']), 'w').write(said)\n")


def test_an_interrupt_is_one_sigint_and_each_ranks_finally_has_its_time(kernel, tmp_path):
    """The launch contract's ``interrupt`` (SIGINT now), then the group's stop: its ladder sends no second SIGINT
    into the cells' ``finally`` blocks, and gives them its grace (a file outside the repository: every rank's)."""
    msg_id, started = kernel.submit(FINALLY_ON_INTERRUPT.format(folder=str(tmp_path)))
    kernel.wait_for_stream(msg_id, ("[rank 0] sleeping", "[rank 1] sleeping"))
    kernel.manager.interrupt_kernel()
    assert kernel.collect(msg_id, started).error["ename"] == "KeyboardInterrupt"
    assert sorted((path.name, path.read_text()) for path in tmp_path.iterdir()) == [
        ("rank0", "finally ran"), ("rank1", "finally ran")]
    _assert_usable(kernel)


BAD_CELLS = [
    "#pragma taas --device cpu --gpus 0\nprint('ran')",
    "#pragma taas --device cpu --gpus 2 --gpus 2\nprint('ran')",
    "#pragma taas --device cpu --gpus 2 --turbo\nprint('ran')",
    "print('ran')\n#pragma taas --device cpu --gpus 2",
    "#pragma taas --device cpu --gpus 2\n#pragma taas --device cpu --gpus 2\nprint('ran')",
]


@pytest.mark.parametrize("cell", BAD_CELLS)
def test_usage_errors_launch_nothing(kernel, cell):
    ran = kernel.execute(cell)
    assert ran.reply["status"] == "error"
    assert ran.error["ename"] == "PragmaError"
    assert len(ran.error["traceback"]) == 2 and ran.error["traceback"][0].startswith("UsageError: taas: ")
    assert "ran" not in ran.stream() and "rank(s)" not in ran.stream()
    assert kernel.children() == []


def test_syntax_error_is_one_line_with_the_cells_line_number(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nx = 1\ny = = 2\n")
    assert ran.error["ename"] == "TaasError"
    assert ran.error["traceback"] == ["TaasError: taas: SyntaxError on line 3 of the cell: invalid syntax: 'y = = 2'"]


def test_unpicklable_name_stops_the_launch(kernel):
    kernel.execute("import threading\nlock = threading.Lock()")
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nwith lock:\n    print('ran')")
    assert ran.error["ename"] == "ClosureError"
    assert "`lock` (_thread.lock)" in ran.error_text()
    assert "ran" not in ran.stream() and kernel.children() == []


def test_unused_names_are_never_pickled(kernel):
    kernel.execute(
        "class Huge:\n    def __reduce__(self):\n        raise RuntimeError('Huge was pickled')\nhuge = Huge()"
    )
    ran = kernel.execute("#pragma taas --device cpu --gpus 1\nsmall = 1")
    assert ran.reply["status"] == "ok", ran.error_text()


def test_a_rerun_cell_does_not_ship_the_names_it_rebinds(kernel):
    # The edit-and-run loop: the last run left a model the cell builds again before any
    # use; that old value (unpicklable here) is not shipped, and the new one comes back.
    kernel.execute("import threading\nmodel = threading.Lock()")
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nmodel = [1, 2]\nfor step in range(2):\n    model.append(step)\n")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert kernel.execute("print(model)").stream("stdout") == "[1, 2, 0, 1]\n"


def test_ranks_do_not_import_ipython_unless_the_cell_does(kernel):
    # The kernel's UI stack costs a rank about 80 ms to import and is no business of its.
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nimport sys\nprint('ipython', 'IPython' in sys.modules)")
    assert ran.stream("stdout").splitlines()[-1] == "ipython False", ran.stream()


def test_kernel_listeners_are_loopback_and_refuse_strangers(kernel, tmp_path):
    done = tmp_path / "done"  # the ranks run (connected) until the test has looked, however long that takes
    msg_id, started = kernel.submit(
        "#pragma taas --device cpu --gpus 2\nimport os, time\nprint('up', flush=True)\n"
        f"while not os.path.exists({str(done)!r}):\n    time.sleep(0.05)\n'finished'"
    )
    try:
        kernel.wait_for_stream(msg_id, "up")
        listening = [c for c in psutil.Process(kernel.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert all(c.laddr.ip == "127.0.0.1" for c in listening), listening
        rank_peers = {c.raddr.port for rank in kernel.children() for c in rank.net_connections(kind="inet") if c.raddr}
        ours = [c.laddr.port for c in listening if c.laddr.port in rank_peers]
        assert len(ours) == 1, "the ranks should be connected to exactly one kernel listener"
        stranger = socket.create_connection(("127.0.0.1", ours[0]), timeout=60)
        nonce = stranger.recv(wire.NONCE_SIZE)
        assert len(nonce) == wire.NONCE_SIZE
        stranger.sendall(wire.hello_mac(wire.new_key(), nonce, 0) + wire.RANK.pack(0))
        assert stranger.recv(1) == b""  # dropped, nothing of it unpickled
        stranger.close()
    finally:
        done.touch()
    ran = kernel.collect(msg_id, started)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.result["text/plain"] == "'finished'"


@pytest.mark.parametrize(
    "wait",
    [
        "time.sleep(120)",
        # C code that holds the GIL and that no signal interrupts (a collective whose peer
        # died waits like this): no Python thread or signal handler of the rank can run, only
        # the watchdog process is left to act. A default mutex locked twice never returns.
        "mutex = ctypes.create_string_buffer(64)\n"
        "ctypes.PyDLL(None).pthread_mutex_lock(mutex)\nctypes.PyDLL(None).pthread_mutex_lock(mutex)",
    ],
)
def test_no_rank_outlives_a_killed_kernel(wait, new_kernel):
    victim = new_kernel()
    msg_id, _ = victim.submit(
        "#pragma taas --device cpu --gpus 2 --output all\nimport ctypes, subprocess, time\nsubprocess.Popen(['sleep', '120'])\n"
        f"print('up', flush=True)\n{wait}"
    )
    victim.wait_for_stream(msg_id, ("[rank 0] up", "[rank 1] up"))
    sleeps = _wait_for(lambda: [p for p in victim.children() if p.name() == "sleep"], 2)
    descendants = victim.children()
    assert len(sleeps) == 2 and len(descendants) >= 4  # two ranks and their sleeps
    os.kill(victim.pid, signal.SIGKILL)
    alive = wait_until_gone(descendants, timeout=30)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def _wait_for(found, count: int, timeout: float = 60) -> list:
    """Poll ``found()`` until it lists ``count`` things (or the timeout passes): what it lists last."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            items = found()
        except psutil.NoSuchProcess:
            items = []
        if len(items) >= count or time.monotonic() > deadline:
            return items
        time.sleep(0.02)


@pytest.mark.minimums
def test_unload_removes_everything(new_kernel):
    fresh = new_kernel()
    fresh.execute("%unload_ext taas_magic")
    ran = fresh.execute("#pragma taas --device cpu --gpus 2\nprint('local')")
    assert ran.reply["status"] == "ok" and ran.stream("stdout") == "local\n"  # a plain comment now
    assert fresh.execute("%taas status").reply["status"] == "error"
    assert fresh.execute("%load_ext taas_magic").reply["status"] == "ok"
    again = fresh.execute("#pragma taas --device cpu --gpus 1\nprint('remote')")
    assert "taas: 1 rank(s)" in again.stream("stdout")
