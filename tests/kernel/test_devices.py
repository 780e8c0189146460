"""Any number of GPUs: ``--gpus auto`` and ``--device``, on this host (CPU ranks; tests/gpu has the GPU side)."""

import pytest

from taas_magic.launch.rankenv import visible_gpu_count

pytestmark = pytest.mark.skipif(visible_gpu_count() > 0, reason="the CPU host's behaviour; tests/gpu covers GPU hosts")


def test_gpus_auto_on_a_host_without_gpus_is_two_cpu_ranks_and_says_why(kernel):
    ran = kernel.execute("#pragma taas --gpus auto --output all\nimport os\nprint('world', os.environ['WORLD_SIZE'])")
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    assert out.startswith("taas: 2 rank(s) (--gpus auto: no GPU on this host, so 2 CPU ranks to show DDP) · CPU, "
                          "backend gloo"), out
    assert "[rank 0] world 2" in out and "[rank 1] world 2" in out


def test_device_cpu_runs_gloo_and_the_ranks_see_no_gpu(kernel):
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2\nimport os, torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl', init_method='env://')\n"
        "print('seen', repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.is_available(), dist.get_backend())\n"
        "dist.destroy_process_group()"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    assert "CPU (--device cpu), backend gloo" in out.splitlines()[0]
    assert "seen None False gloo" in out  # on a host without GPUs there is nothing to hide


def test_device_cuda_on_a_host_without_gpus_is_one_line_and_launches_nothing(kernel):
    ran = kernel.execute("#pragma taas --device cuda --gpus 1\nprint('ran')")
    assert ran.reply["status"] == "error" and ran.error["ename"] == "LaunchError"
    assert ran.error["traceback"] == ["LaunchError: taas: --device cuda, but this host has no GPU (none visible to the "
                                      "kernel); leave --device out or use --device cpu to run the ranks on CPU"]
    assert "ran" not in ran.stream() and "rank(s)" not in ran.stream()
    assert kernel.execute("print('usable')").stream() == "usable\n"

