"""Benchmarks: ``python -m adapter bench NAME [--quick]``; each ``run(quick)`` prints a table and
returns its figures, which the CLI prints as the last line (one JSON object)."""

BENCHMARKS = {
    "startup": "devkit.bench.startup:run",
    "kv-park": "devkit.bench.kv_park:run",
    "decode-yield": "devkit.bench.decode_yield:run",
    "decode-yield-ranks": "devkit.bench.decode_yield_ranks:run",
    "decode-yield-engine": "devkit.bench.decode_yield_engine:run",
    "decode-yield-engine-dsv4": "devkit.bench.decode_yield_engine:run_dsv4",
    "decode-yield-reference": "devkit.bench.decode_yield_reference:run",
    "decode-yield-reference-dsv4": "devkit.bench.decode_yield_reference:run_dsv4",
    "native-decode": "devkit.bench.native_decode:run",
    "swa-thin": "devkit.bench.swa_thin:run",
    "swa-thin-hicache": "devkit.bench.swa_thin_hicache:run",
    "cone-replay": "devkit.bench.cone_replay:run",
    "cone-replay-dsv4": "devkit.bench.cone_replay_dsv4:run",
    "admission": "devkit.bench.admission:run",
    "metrics-overhead": "devkit.bench.metrics_overhead:run",
    "hicache": "devkit.bench.hicache:run",
    "swa-host-demote": "devkit.bench.swa_host_demote:run",
    "chat-latency": "devkit.bench.chat_latency.entry:run",
    "chat-latency-scripted": "devkit.bench.chat_scripted:run",
    "chat-latency-varied": "devkit.bench.chat_latency:run_varied",
    "fleet": "devkit.bench.fleet:run",
    # -- end of benchmarks --
}
