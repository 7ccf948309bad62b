"""Power-limit and clock control with the restore guarantee."""
