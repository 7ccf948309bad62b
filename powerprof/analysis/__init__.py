"""Curves, sweet-spot fitting, report, plots and export."""
