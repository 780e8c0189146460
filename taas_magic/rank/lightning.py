"""Lightning's ``self.log(...)`` in the live chart, with no change to the cell.

Runs in each rank, on the cell's thread, where Lightning calls its loggers.

When a cell imports Lightning (``lightning.pytorch`` or ``pytorch_lightning``), every
``Trainer`` it makes gets one more logger, :func:`logger`, which passes what Lightning logs
(every ``log_every_n_steps``, on the ranks Lightning logs from) to ``taas.report``. The
cell's own loggers (TensorBoard, CSV, W&B) stay as they are; ``logger=False`` means no
logging at all, and then nothing is added. A cell may also pass ``taas.lightning_logger()``
itself, e.g. beside its own loggers: it is not added twice.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable


def logger(report: Callable[..., None], base: type | None = None) -> Any:
    """A Lightning logger whose ``log_metrics`` is ``report`` (``taas.report`` where it is made)."""
    if base is None:
        from lightning.pytorch.loggers.logger import Logger as base
    made = _logger_class(base)()
    made.report = report
    return made


@functools.cache
def _logger_class(base: type) -> type:
    class TaasLogger(base):  # Lightning's Logger, chosen at run time
        """Lightning's metrics to the taas cell's live chart."""

        report: Callable[..., None]

        @property
        def name(self) -> str:
            return "taas"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass  # the chart draws metrics; hyperparameters are the cell's own loggers' business

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.report(step=step, **{name: value for name, value in metrics.items() if name != "epoch"})

    return TaasLogger


def add_to_trainers(module: ModuleType, report: Callable[..., None]) -> None:
    """Wrap ``module.Trainer.__init__`` so a Trainer that logs also logs to the chart."""
    from importlib import import_module

    base = import_module(module.__name__ + ".loggers.logger").Logger
    trainer = module.Trainer
    original = trainer.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        taas_logger = _logger_class(base)
        if kwargs.get("logger", True) is not False and not any(isinstance(each, taas_logger) for each in self.loggers):
            self.loggers = [*self.loggers, logger(report, base)]

    trainer.__init__ = __init__
