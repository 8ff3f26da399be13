"""Benchmarks: ``python -m adapter bench NAME [--quick]``; each ``run(quick)`` prints a table and
returns its figures, which the CLI prints as the last line (one JSON object)."""

BENCHMARKS = {
    "startup": "adapter.bench.startup:run",
    "kv-park": "adapter.bench.kv_park:run",
    "decode-yield": "adapter.bench.decode_yield:run",
    "native-decode": "adapter.bench.native_decode:run",
    "swa-thin": "adapter.bench.swa_thin:run",
    "cone-replay": "adapter.bench.cone_replay:run",
    "admission": "adapter.bench.admission:run",
    # -- end of benchmarks --
}
