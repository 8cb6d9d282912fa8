"""netweave benchmarks: each ``bench_*.py`` writes JSON + a markdown table to ``$NETWEAVE_BENCH_OUT`` or ``bench/results/`` (see ``_common``)."""
