"""Benchmarks: ``python -m adapter bench NAME [--quick]``; each ``run(quick)`` prints a table and
returns its figures, which the CLI prints as the last line (one JSON object)."""

BENCHMARKS = {
    "startup": "adapter.bench.startup:run",
    # -- end of benchmarks --
}
