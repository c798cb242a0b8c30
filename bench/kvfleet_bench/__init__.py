"""Benchmark harnesses behind `kvfleet bench ...`: each prints numbers with a same-run baseline
and writes a markdown report with PNG plots to bench/results/."""
