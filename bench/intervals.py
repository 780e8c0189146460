"""How sure a median is: a 95% interval of it, for the benches' paired ratios (bench/keep.py ``--paired``).

This machine's paired ratios spread widely (0.56x to 1.80x for one cell against another's), so a median alone
cannot say whether one tool is above, at or below another; its interval can.
"""

from __future__ import annotations

import random
import statistics


def median_interval(samples: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of the median of ``samples``: the percentile bootstrap, ``draws`` resamples, seeded (the same
    samples give the same interval)."""
    chooser = random.Random(seed)
    medians = sorted(statistics.median(chooser.choices(samples, k=len(samples))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]
