"""The cell stage: the cell's text -> Python with its line numbers, its options, the names it reads and their values."""
