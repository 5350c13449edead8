"""Measurement series: suites (predictions first), sweeps, the side-by-side baseline."""
