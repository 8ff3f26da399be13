"""Record SGLang's forward-pass metrics (``--enable-forward-pass-metrics``) as JSON lines.

The scheduler publishes each ``ForwardPassMetrics`` msgpack-encoded on a ZMQ PUB socket at
``<ipc name>.<dp rank>``; :class:`Recorder` subscribes and writes one JSON object per message, the
input of ``python -m adapter fit-cost-model``. It decodes with the upstream struct, so it imports
``sglang.srt.observability.forward_pass_metrics`` (light: msgspec only) when started.

Each line also carries ``recv_time``: this process's ``time.monotonic()`` when the message arrived.
The scheduler emits one message at the end of every iteration (``process_batch_result``), so the
gap between two consecutive busy messages is that iteration's whole wall time: forward, scheduling
and output processing (``wall_time`` is the forward alone). ``fit-cost-model`` fits both; the upstream
decoder ignores the extra key.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


class Recorder:
    def __init__(self, ipc_name: str, out: str | Path, dp_rank: int = 0):
        self.endpoint = f"{ipc_name}.{dp_rank}"
        self.out = Path(out)
        self.messages = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Recorder:
        import msgspec
        import zmq
        from sglang.srt.observability.forward_pass_metrics import decode

        context = zmq.Context.instance()
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 200)
        sock.connect(self.endpoint)  # a SUB may connect before the PUB binds: ZMQ reconnects
        self.out.parent.mkdir(parents=True, exist_ok=True)

        def run() -> None:
            with open(self.out, "wb") as handle:
                while not self._stop.is_set():
                    try:
                        frames = sock.recv_multipart()
                    except zmq.Again:
                        continue
                    received = time.monotonic()
                    line = msgspec.json.encode(decode(frames[-1]))  # an object: append the arrival time
                    handle.write(line[:-1] + b',"recv_time":' + repr(received).encode() + b"}\n")
                    handle.flush()
                    self.messages += 1
            sock.close(linger=0)

        self._thread = threading.Thread(target=run, name="fpm-recorder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        return self.messages
