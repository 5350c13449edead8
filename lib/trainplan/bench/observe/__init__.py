"""Watching a run: the progress monitor, profiler buckets, communication report."""
