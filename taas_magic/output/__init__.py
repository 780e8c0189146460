"""What the ranks show: their text relayed into the cell within a budget, rich output, and the live chart fed by taas.report."""
