"""taas.register: data workers prepare a loader's elements for the ranks (--cpus, --units).

Every test runs real cells in a real kernel: real worker processes, real gloo ranks
that gather what each of them saw with ``all_gather_object``; rank 0's gathered view
comes back to the notebook and is checked here.
"""

import json
import re
import time

import pytest

SETUP = """
import json, time, torch, taas
from torch.utils.data import DataLoader, Dataset, IterableDataset

class Ids(Dataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return torch.tensor(i)

class Sharded(IterableDataset):
    '''Splits its range between DataLoader workers, as torch's docs recommend.'''
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, workers))
"""

GATHER = """
import torch.distributed as dist
dist.init_process_group("gloo")
epochs = []
for epoch in range({epochs}):
    mine = []
    for batch in loader:
        mine.append(batch.tolist())
        batch.add_(100000)  # in place: must not reach the cache that later passes replay
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    epochs.append(everyone)
dist.destroy_process_group()
"""


@pytest.fixture
def data_kernel(kernel):
    ran = kernel.execute(SETUP)
    assert ran.reply["status"] == "ok", ran.error_text()
    yield kernel
    kernel.execute("[taas.unregister(loader) for loader in taas.registered()];")


def _gathered(kernel, pragma: str, epochs: int):
    ran = kernel.execute(pragma + "\n" + GATHER.format(epochs=epochs), timeout=180)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    shown = kernel.execute("print(json.dumps(epochs))")
    return json.loads(shown.stream("stdout")), ran


def _progress(ran) -> list[str]:
    return [
        m.content["data"]["text/plain"]
        for m in ran.messages
        if m.type in ("display_data", "update_display_data") and "taas data" in m.content["data"].get("text/plain", "")
    ]


def _flat(batches):
    return [value for batch in batches for value in (batch if isinstance(batch, list) else [batch])]


@pytest.mark.minimums
def test_map_loader_split_between_ranks_disjoint_complete_equal_then_replayed(data_kernel):
    # 103 samples in batches of 10: 11 elements a pass; 2 ranks get 5 each, one is dropped.
    data_kernel.execute("loader = taas.register(DataLoader(Ids(103), batch_size=10, shuffle=True))")
    epochs, ran = _gathered(data_kernel, "#pragma taas --device cpu --gpus 2 --cpus 2", epochs=3)
    assert "data: 2 workers prepare loader (map, 11 per pass, shuffled, --units 11 = 1 pass)" in ran.stream()
    first = epochs[0]
    assert [len(rank) for rank in first] == [5, 5]  # equal shares, the remainder dropped
    ids = _flat(first[0]) + _flat(first[1])
    assert len(ids) == len(set(ids)) == 100  # disjoint; ten full batches: the short one was dropped
    assert all(0 <= i < 103 for i in ids)

    batches = {frozenset(batch) for rank in first for batch in rank}
    for replayed in epochs[1:]:
        assert [len(rank) for rank in replayed] == [5, 5]
        assert max(_flat(replayed[0]) + _flat(replayed[1])) < 103  # the in-place add never reached the cache
        assert {frozenset(batch) for rank in replayed for batch in rank} == batches  # the same prepared elements
    orders = [[batch for rank in epoch for batch in rank] for epoch in epochs]
    assert orders[0] != orders[1] != orders[2]  # a new order each replayed pass (the loader shuffles)
    final = _progress(ran)[-1]
    assert "loader: 10/10 extracted" in final and "20 replayed from cache" in final


def test_element_i_goes_to_rank_i_mod_n_in_the_loaders_own_order(data_kernel):
    data_kernel.execute("loader = taas.register(DataLoader(Ids(40), batch_size=4))")
    epochs, _ = _gathered(data_kernel, "#pragma taas --device cpu --gpus 2 --cpus 3", epochs=1)
    batches = [list(range(start, start + 4)) for start in range(0, 40, 4)]
    assert epochs[0][0] == batches[0::2]
    assert epochs[0][1] == batches[1::2]


def test_units_covering_several_passes_extracts_every_pass_afresh(data_kernel):
    data_kernel.execute("loader = taas.register(DataLoader(Ids(40), batch_size=4, shuffle=True))")
    epochs, ran = _gathered(data_kernel, "#pragma taas --device cpu --gpus 2 --cpus 2 --units 30", epochs=4)
    compositions = []
    for epoch in epochs:
        assert [len(rank) for rank in epoch] == [5, 5]
        ids = _flat(epoch[0]) + _flat(epoch[1])
        assert sorted(ids) == list(range(40))  # each fresh pass is complete
        compositions.append({frozenset(batch) for rank in epoch for batch in rank})
    assert compositions[0] != compositions[1] != compositions[2]  # the sampler reshuffled each fresh pass
    assert compositions[3] == compositions[0]  # K = 3 passes: the fourth replays the first
    final = _progress(ran)[-1]
    assert "loader: 30/30 extracted" in final and "10 replayed from cache" in final


def test_loader_without_len_needs_units(data_kernel):
    data_kernel.execute("loader = taas.register(DataLoader(Sharded(50), batch_size=5))")
    ran = data_kernel.execute("#pragma taas --device cpu --gpus 2\nfor batch in loader: pass")
    assert ran.error is not None and ran.error_text().startswith("DataPlanError: taas:")
    assert "has no len()" in ran.error_text() and "--units K" in ran.error_text()
    assert "rank(s)" not in ran.stream()  # nothing was launched


def test_iterable_dataset_shards_by_worker_info_fresh_passes_then_replay(data_kernel):
    # Sharded(50) in batches of 5: each of 2 workers yields 5 batches of its half.
    data_kernel.execute("loader = taas.register(DataLoader(Sharded(50), batch_size=5))")
    epochs, ran = _gathered(data_kernel, "#pragma taas --device cpu --gpus 2 --cpus 2 --units 20", epochs=3)
    for epoch in epochs:
        assert [len(rank) for rank in epoch] == [5, 5]
        assert sorted(_flat(epoch[0]) + _flat(epoch[1])) == list(range(50))  # every item once: sharded
    for epoch in epochs:  # a batch holds one worker's shard: all even or all odd
        assert all(len({value % 2 for value in batch}) == 1 for rank in epoch for batch in rank)
    assert "20/20 extracted" in _progress(ran)[-1] and "10 replayed" in _progress(ran)[-1]


def test_plain_reiterables_with_and_without_len(data_kernel):
    data_kernel.execute(
        "class Gen:\n"
        "    def __iter__(self):\n"
        "        info = torch.utils.data.get_worker_info()\n"
        "        return (torch.tensor([i]) for i in range(info.id, 12, info.num_workers))\n"
        "loader = taas.register([torch.tensor([i]) for i in range(6)])\n"
        "stream = taas.register(Gen())"
    )
    ran = data_kernel.execute(
        "#pragma taas --device cpu --gpus 2 --cpus 2 --units 12 --output all\n"
        "import os\n"
        "print('list', [int(x) for x in loader], len(loader), flush=True)\n"
        "print('gen', sorted(int(x) for x in stream), flush=True)\n",
        timeout=120,
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    assert "[rank 0] list [0, 2, 4] 3" in out and "[rank 1] list [1, 3, 5] 3" in out
    gen = [json.loads(line.split("gen ", 1)[1]) for line in out.splitlines() if " gen " in line]
    assert sorted(gen[0] + gen[1]) == list(range(12)) and len(gen[0]) == len(gen[1]) == 6


def test_failing_worker_names_worker_element_and_traceback_and_stops_the_run(data_kernel):
    data_kernel.execute(
        "class Flaky(Dataset):\n"
        "    def __len__(self):\n"
        "        return 64\n"
        "    def __getitem__(self, i):\n"
        "        if i == 37:\n"
        "            print('failing at', time.time(), flush=True)\n"
        "            raise ValueError(f'sample {i} is corrupt')\n"
        "        return torch.tensor(i)\n"
        "flaky = taas.register(DataLoader(Flaky(), batch_size=None))"
    )
    msg_id, started = data_kernel.submit("#pragma taas --device cpu --gpus 2 --cpus 2\nfor epoch in range(2):\n    for x in flaky: pass")
    ran = data_kernel.collect(msg_id, started, timeout=60)
    ended = time.time()
    assert ran.error is not None
    text = ran.error_text()
    failed_at = float(re.search(r"failing at ([\d.]+)", text).group(1))  # the worker's last output line
    assert ended - failed_at < 5
    assert "data worker 1 on localhost raised ValueError: sample 37 is corrupt" in text
    assert "element 37 of pass 0 of flaky" in text
    assert "raise ValueError(f'sample {i} is corrupt')" in text  # the notebook's own line
    assert "every rank and worker was stopped" in text
    assert data_kernel.execute("print(6 * 7)").stream() == "42\n"  # the kernel is usable


def test_unregistered_and_unused_loaders_behave_as_without_taas(data_kernel):
    data_kernel.execute(
        "loader = taas.register(DataLoader(Ids(10), batch_size=2))\n"
        "other = taas.register(DataLoader(Ids(4), batch_size=2))\n"
        "taas.unregister(loader)"
    )
    ran = data_kernel.execute(
        "#pragma taas --device cpu --gpus 2 --output all\nprint(type(loader).__name__, [b.tolist() for b in loader], flush=True)"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "data:" not in ran.stream()  # `other` is registered but unused: no workers
    full = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert f"[rank 0] DataLoader {full}" in ran.stream() and f"[rank 1] DataLoader {full}" in ran.stream()
    status = data_kernel.execute("%taas status").stream()
    assert "registered loaders: other (DataLoader, map, 2 per pass)" in status


def test_cache_spills_to_disk_past_its_ram_bound_and_workers_wait_for_the_ranks(data_kernel):
    data_kernel.execute(
        "class Images(Dataset):\n"
        "    def __len__(self):\n"
        "        return 48\n"
        "    def __getitem__(self, i):\n"
        "        return torch.full((64, 1, 28, 28), float(i))  # 200 kB, an MNIST batch\n"
        "images = taas.register(DataLoader(Images(), batch_size=None))"
    )
    ran = data_kernel.execute(
        "#pragma taas --device cpu --gpus 2 --cpus 2 --cache-ram 4M --ahead 2\n"
        "import time\n"
        "time.sleep(2)  # the workers must wait: at most --ahead elements per rank\n"
        "seen = [float(x.mean()) for x in images]\n"
        "seen_again = [float(x.mean()) for x in images]\n",
        timeout=120,
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert data_kernel.execute("print(seen == [float(i) for i in range(0, 48, 2)] == seen_again)").stream() == "True\n"
    progress = _progress(ran)
    waiting = [int(m.group(1)) for text in progress for m in [re.search(r"([\d,]+) waiting", text)] if m]
    assert waiting and max(waiting) <= 2 * 2 + 2 + 2  # ahead x ranks, + a rank's offset + one per worker
    sizes = re.search(r"cache ([\d.]+ \w?B) in RAM, ([\d.]+ \w?B) on disk", progress[-1]).groups()
    in_ram, on_disk = (_bytes(size) for size in sizes)
    assert in_ram <= 4 * 2**20  # the bound held (the RAM files only grow, so the end is the peak)
    assert on_disk >= 48 * 200_000 - 4 * 2**20  # the rest went to disk


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


SLOW = (
    "class Slow(Dataset):\n"
    "    def __len__(self):\n"
    "        return 200\n"
    "    def __getitem__(self, i):\n"
    "        time.sleep(0.05)\n"
    "        return torch.tensor(i)\n"
    "slow = taas.register(DataLoader(Slow(), batch_size=None))"
)


def test_interrupt_stops_ranks_and_workers(data_kernel):
    data_kernel.execute(SLOW)
    msg_id, started = data_kernel.submit(
        "#pragma taas --device cpu --gpus 2 --cpus 2 --output all\nfor x in slow:\n    print('got', int(x), flush=True)"
    )
    data_kernel.wait_for_stream(msg_id, ("[rank 0] got 0", "[rank 1] got 1"))  # both run (a spare may adopt late)
    assert len(data_kernel.children()) >= 4  # 2 ranks, 2 workers
    interrupted = time.monotonic()
    data_kernel.manager.interrupt_kernel()
    ran = data_kernel.collect(msg_id, started)
    assert ran.error["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - interrupted < 5
    assert data_kernel.execute("print(6 * 7)").stream() == "42\n"


def test_a_rank_failing_mid_extraction_stops_the_workers_too(data_kernel):
    data_kernel.execute(SLOW)
    ran = data_kernel.execute(
        "#pragma taas --device cpu --gpus 2 --cpus 2\nfor x in slow:\n    if int(x) == 4:\n        raise RuntimeError('rank gave up')"
    )
    assert "rank 0 on localhost raised RuntimeError: rank gave up" in ran.error_text()
    assert "extracted" in _progress(ran)[-1]


def test_a_worker_dying_without_a_word_is_named(data_kernel):
    data_kernel.execute(
        "class Dies(Dataset):\n"
        "    def __len__(self):\n"
        "        return 20\n"
        "    def __getitem__(self, i):\n"
        "        if i == 3:\n"
        "            import os; os._exit(3)\n"
        "        return torch.tensor(i)\n"
        "dies = taas.register(DataLoader(Dies(), batch_size=None))"
    )
    ran = data_kernel.execute("#pragma taas --device cpu --gpus 2 --cpus 2\nfor x in dies: pass", timeout=60)
    assert "data worker 1 on localhost exited with code 3 without reporting an error" in ran.error_text()


def test_a_worker_ending_cleanly_before_its_share_is_named_not_waited_for(data_kernel):
    data_kernel.execute(
        "class Quits(Dataset):\n"
        "    def __len__(self):\n"
        "        return 20\n"
        "    def __getitem__(self, i):\n"
        "        if i == 3:\n"
        "            import os; os._exit(0)\n"
        "        return torch.tensor(i)\n"
        "quits = taas.register(DataLoader(Quits(), batch_size=None))"
    )
    ran = data_kernel.execute("#pragma taas --device cpu --gpus 2 --cpus 2 --timeout 50\nfor x in quits: pass", timeout=60)
    assert ran.error["ename"] == "WorkerFailed", ran.error_text()
    assert "data worker 1 on localhost exited before preparing its share of the elements" in ran.error_text()
    data_kernel.execute("taas.unregister(quits)")
