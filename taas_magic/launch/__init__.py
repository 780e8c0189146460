"""Launchers start a cell's ranks and stop them; supervision never asks which one ran."""
