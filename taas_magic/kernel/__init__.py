"""The kernel stage: %%taas plans a run, supervises its ranks, binds rank 0's names and draws the cell."""
