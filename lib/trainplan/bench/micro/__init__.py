"""Microbenchmarks: GEMMs, attention, collectives and the model's own pieces."""
