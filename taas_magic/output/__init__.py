"""What the ranks show: their text relayed into the cell within a budget, rich output, and the live chart fed by taas.report.

- ``relay.py``: rank output -> the run log: incremental UTF-8, ``\\r`` kept, coalesced.
- ``runlog.py``: everything a run shows, sequence-numbered, bounded in the kernel, all on disk.
- ``cellstream.py``: the log as the cell's own output, through the budget.
- ``budget.py``: the head, the elision notice and tail, the full log.
- ``displays.py``: a rank's displays, held until its text reaches them.
- ``board.py``: the live chart (each rank's waiting share its last panel) and the health line's display.
- ``health.py``: the health line: each rank's figures, its time per step split into working and waiting.
- ``straggler.py``: the rank the others wait for, from each rank's share of time waiting in collectives.
- ``collectives.py``: the rank's seconds in collectives and its steps, sent with its health.
- ``ddptiming.py``: DDP's all-reduce in those seconds, from DDP's own timer, read on the cell's thread.
- ``liveview.py``: a view fed from the log on its own thread; the screen; the text view.
- ``widget.py``: the live widget a reloaded page restores (its page half: liveview.js).
- ``frontend.py``: the page the kernel is shown in: does it restore widgets; ``kernel_info`` answered while a
  cell waits; a cell's messages straight to the IOPub thread.
- ``reports.py``: ``taas.report``'s batches in the rank; asynchronous CUDA copies.
- ``trialtable.py``: a search's table and chart, one display.
"""
