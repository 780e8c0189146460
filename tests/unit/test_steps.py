"""rank/steps.py: what counts as one training step, with real torch optimizers (the hooks are torch's own)."""

import pytest
import torch
import torch.optim.optimizer as optimizer_module

from taas_magic.rank import steps


class Lookahead(torch.optim.Optimizer):
    """A wrapper optimizer, as Lookahead and ZeroRedundancyOptimizer are: its step calls its inner one's."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        super().__init__(inner.param_groups[0]["params"], {})

    def step(self, closure=None):
        return self.inner.step(closure)


@pytest.fixture
def counted():
    seen: list[int] = []
    steps.install(optimizer_module)
    steps.listeners.append(lambda: seen.append(1))
    steps.new_cell()
    yield seen
    steps.listeners.pop()
    steps.uninstall()


def _sgd() -> torch.optim.SGD:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    return torch.optim.SGD([weight], lr=0.1)


def test_a_wrapper_optimizers_step_is_one_step(counted):
    wrapped = Lookahead(_sgd())
    for _ in range(3):
        wrapped.step()
    assert len(counted) == 3  # not 6: the inner step is inside the wrapper's


def test_two_optimizers_stepping_each_iteration_are_one_step_paced_by_the_first(counted):
    generator, discriminator = _sgd(), _sgd()
    for _ in range(4):
        discriminator.step()
        generator.step()
    assert len(counted) == 4
    steps.new_cell()  # a kept rank's next cell: its first optimizer paces it
    for _ in range(2):
        generator.step()
    assert len(counted) == 6


def test_a_step_that_raises_is_not_counted_and_the_next_ones_are(counted):
    class Failing(torch.optim.SGD):
        fail = True

        def step(self, closure=None):
            if self.fail:
                raise RuntimeError("nan in the gradients")
            return super().step(closure)

    failing = Failing(_sgd().param_groups[0]["params"], lr=0.1)
    with pytest.raises(RuntimeError):
        failing.step()
    failing.fail = False
    failing.step()  # the cell caught it and goes on: its steps count again
    failing.step()
    assert len(counted) == 2
    with pytest.raises(RuntimeError):
        Failing(_sgd().param_groups[0]["params"], lr=0.1).step()  # a second optimizer's step raises, is caught
    failing.step()  # the pacer's steps count on
    assert len(counted) == 3
    steps.new_cell()  # and a new cell forgets a step that never ended
    with pytest.raises(RuntimeError):
        Failing(_sgd().param_groups[0]["params"], lr=0.1).step()
    steps.new_cell()
    _sgd().step()
    assert len(counted) == 4


def test_a_listener_may_leave_while_the_listeners_are_called(counted):
    def once():
        steps.listeners.remove(once)

    steps.listeners.insert(0, once)
    _sgd().step()
    assert once not in steps.listeners and len(counted) == 1
