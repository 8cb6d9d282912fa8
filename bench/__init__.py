"""netweave benchmarks: each ``bench_*.py`` writes JSON + a markdown table to ``bench/results/``."""
