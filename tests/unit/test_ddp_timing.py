"""output/collectives.py on real DDP models (gloo, one rank, in a fresh process: the wrappers patch torch for good).

DDP's gradient all-reduce is timed by DDP's own C++ timer, which taas turns on for every iteration of each model
(no Python in the step: a communication hook cost 30 µs a bucket); DDP's buffer broadcast (BatchNorm) is timed with
the other collectives; a person's communication hook, registered before or after the first forward, is DDP's own
(its dist.* calls timed, the model's timer not counted twice); ``%taas heal`` rebuilds every DDP model's reducer
(DDP's unpickling), which keeps its timer and gets the model's hook again (it came without it).
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import math, tempfile, time
    from taas_magic.import_hooks import when_imported
    from taas_magic.output import collectives
    collectives.install(False, when_imported)
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    clock, ddp_times = collectives.clock, collectives.ddp_times

    def step(model, times=1):
        for _ in range(times):
            model.zero_grad()
            model(torch.randn(8, 4)).sum().backward()

    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    before = clock.seconds(time.monotonic())
    model(torch.randn(8, 4))  # the first forward: DDP broadcasts BatchNorm's buffers
    print("broadcast timed", clock.seconds(time.monotonic()) > before)  # no other collective in a forward
    print("no hook of taas's", model._comm_hooks == [])
    step(model, 5)
    first = ddp_times.seconds()
    print("ddp timed", first > 0, "read again, nothing new", ddp_times.seconds() == first)
    step(model, 3)
    data = model._get_ddp_logging_data()
    print("three steps more, counted as three of the latest",
          math.isclose(ddp_times.seconds() - first, data["backward_comm_time"] / 1e9 * 3, rel_tol=1e-9))

    calls = []
    def theirs(state, bucket):
        calls.append(state)
        return default_hooks.fp16_compress_hook(None, bucket)
    model.register_comm_hook("their state", theirs)  # after the first forward, as DDP allows without taas
    counted, before = ddp_times.seconds(), clock.seconds(time.monotonic())
    step(model, 2)
    print("their hook called", calls == ["their state"] * 2, "its dist.* calls timed", clock.seconds(time.monotonic()) > before,
          "the model's timer not counted too", ddp_times.seconds() == counted)
    built = DDP(torch.nn.Linear(4, 4))
    built._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    step(built, 2)
    print("a built-in hook's all-reduce timed", ddp_times.seconds() > counted)

    # %taas heal rebuilds every DDP model's reducer (DDP's pickling pair), which comes without the hook
    from taas_magic.rank import heal
    own_calls = []
    def own(state, bucket):
        own_calls.append(state)
        return default_hooks.allreduce_hook(None, bucket)
    plain = DDP(torch.nn.Linear(4, 4))
    plain.register_comm_hook("own", own)  # before the first forward
    bare = DDP(torch.nn.Linear(4, 4))
    step(bare, 12)  # past DDP's first ten iterations, which it records whatever its rate
    models = {"model": model, "plain": plain, "bare": bare}
    print(heal._rebuild_ddp(models))
    calls.clear()
    for each in models.values():
        step(each, 12)
    print("after heal: their hook", calls == ["their state"] * 12, "own hook", own_calls == ["own"] * 12)
    print("after heal: the bare model's timer at every iteration", bare._get_ddp_logging_data()["iteration"] == 11)
    def has_hook(each):
        try:
            dist._register_comm_hook(each.reducer, None, default_hooks.allreduce_hook)
        except RuntimeError as error:
            return "can only be called once" in str(error)
        return False
    print("reducers with their hook", {name: has_hook(each) for name, each in models.items()})
    dist.destroy_process_group()
""")


def test_ddp_is_timed_by_its_own_timer_its_buffer_broadcast_too_a_persons_hooks_are_its_own_and_heal_keeps_them():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "broadcast timed True",
        "no hook of taas's True",
        "ddp timed True read again, nothing new True",
        "three steps more, counted as three of the latest True",
        "their hook called True its dist.* calls timed True the model's timer not counted too True",
        "a built-in hook's all-reduce timed True",
        "[\"taas: heal: DDP's reducer rebuilt on every rank for bare, model, plain\"]",
        "after heal: their hook True own hook True",
        "after heal: the bare model's timer at every iteration True",
        "reducers with their hook {'model': True, 'plain': True, 'bare': False}",
    ], done.stdout + done.stderr
