"""Checkpoint cadence against node failures, failure simulation, the fault matrix."""
