"""``--profile [N]``: every rank profiled for a bounded window, one merged trace, each rank's time split; both halves.

- ``window.py`` (the rank's half): ``torch.profiler`` over the cell, stepped by the step marks (``optimizer.step``
  or ``taas.report``), stopped once N steps after the first are recorded, torn down when the cell ends however it
  ends; the trace and the rank's clock offset (a timestamp exchange over its channel) sent to the kernel, and the
  frames for both (``ClockAsk``, ``ClockTime``, ``ProfileTrace``);
- ``breakdown.py`` (the rank's, before its trace is cut to size): its window split into working, communicating and
  idle waiting, and its top five operators by self time;
- ``bound.py`` (both): a trace held to a size (each rank its share before sending, the merge as a last guard):
  the shortest events first, with the flow arrows on them, then counters and flows;
- ``merge.py`` (the kernel's): the ranks' traces in one Chrome/Perfetto file, one process ``rank K`` each, clocks
  aligned, at most 200 MB, saved with each rank's own file (for HTA) in the notebook's folder.

The kernel stage (kernel/runs/profiled.py) puts the breakdown beside output/straggler.py's line.
"""
