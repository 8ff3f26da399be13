"""Start SGLang's HTTP server on CPU for tests and the gate, wait for it, and always stop all of it.

``Server`` runs ``python -m sglang.launch_server`` on 127.0.0.1 in a new session (its own process
group), with ``PYTHONPATH`` = the ``sgl_kernel`` stand-in + the overlay's repo root (so the
overlay's ``sitecustomize`` sees the ``DSV41_*`` keys of the profile, and only those: inherited
``DSV41_*`` keys are dropped, so a stock boot is stock). It waits until the log says the server is
up and ``/health`` answers; if the process exits first or the wait times out it stops everything
and raises :class:`ServerFailed` with the log's tail.

``stop()`` sends SIGTERM to the process group, then SIGKILL, then sweeps ``/proc`` for anything
still in the group or the session, and returns what it had to kill late (tests assert it is
empty of survivors). The command runs under ``timeout`` too, so even a killed test runner leaves
no server older than ``max_life_s``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_PATH = Path(__file__).resolve().parent / "stub"
READY_LINE = "The server is fired up"
# CPU engine defaults: the CPU path, one thread per process (2-core machines), nothing from the net.
BASE_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def load_stub_module(name: str):
    """One module of the ``sgl_kernel`` stand-in (``_route``, ``kvcacheio``, ...) loaded by path, for
    in-process tests: importing the stand-in package would reroute this process's attention backends."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"dsv41_stub_{name}", STUB_PATH / "sgl_kernel" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ServerFailed(RuntimeError):
    """The server did not come up (exited, or not ready in time); everything it started is stopped."""


PORT_RETRIES = 2
PORT_TAKEN = "address already in use"  # uvicorn's bind error (errno 98)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_args(model: str | Path, port: int, *, max_total_tokens: int = 16384, chunk: int = 64,
                swa_ratio: float | None = None, seed: int = 0, extra: Sequence[str] = ()) -> list[str]:
    """The launch_server arguments every boot of the kit shares (A/B/A boots differ only in env)."""
    for name, value, low in (("max_total_tokens", max_total_tokens, 256), ("chunk", chunk, 16), ("port", port, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {low}")
    args = [
        "--model-path", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
        "--disable-cuda-graph", "--attention-backend", "torch_native", "--dtype", "float32",
        "--max-total-tokens", str(max_total_tokens), "--chunked-prefill-size", str(chunk), "--page-size", "1",
        "--random-seed", str(seed), "--enable-cache-report", "--skip-server-warmup", "--log-level", "info",
    ]
    if swa_ratio is not None:
        if not 0 < swa_ratio <= 1:
            raise ValueError(f"swa_ratio={swa_ratio!r} is invalid: expected 0 < swa_ratio <= 1")
        args += ["--swa-full-tokens-ratio", str(swa_ratio)]
    return args + list(extra)


def child_env(profile: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` without DSV41_* keys, the CPU engine keys, then ``profile``."""
    bad = [k for k in profile if not k.startswith("DSV41_") and k not in BASE_ENV]
    if bad:
        raise ValueError(f"profile keys {bad!r} are invalid: a profile holds only DSV41_* keys")
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("DSV41_")}
    env.update(BASE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(STUB_PATH), str(REPO_ROOT)])
    env.update(profile)
    return env


SEAMS_PATH = Path(__file__).resolve().parent / "seams"


def with_seams(env: Mapping[str, str], *seams: str, **settings: str) -> dict[str, str]:
    """``env`` with the kit's test seams ``seams`` (modules of ``seams/``, see its ``sitecustomize``)
    put first on ``PYTHONPATH``, and their settings."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join([str(SEAMS_PATH), out.get("PYTHONPATH") or str(REPO_ROOT)])
    out["KIT_SEAMS"] = ",".join(seams)
    out.update(settings)
    return out


def _proc_ids(pid: int) -> tuple[int, int] | None:
    """(process group, session) of ``pid`` from /proc, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
    if fields[0] == "Z":  # a zombie holds no resources; its parent reaps it
        return None
    return int(fields[2]), int(fields[3])


def members(group: int) -> list[int]:
    """Live processes whose process group or session is ``group``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ids = _proc_ids(int(entry))
            if ids is not None and group in ids:
                found.append(int(entry))
    return found


class Server:
    def __init__(self, args: Sequence[str], log_path: str | Path, profile: Mapping[str, str] | None = None,
                 *, ready_timeout_s: float = 300.0, max_life_s: int = 1800, python: str = sys.executable,
                 ready_line: str = READY_LINE, env: Mapping[str, str] | None = None,
                 cwd: str | Path = REPO_ROOT):
        self.args = list(args)
        self.port = int(self.args[self.args.index("--port") + 1])
        self.log_path = Path(log_path)
        self.profile = dict(profile or {})
        # ``env``: a kit's own server environment (the DSV4 kit's ``launch.child_env``); default child_env(profile)
        self.env = child_env(self.profile) if env is None else dict(env)
        self.ready_timeout_s = ready_timeout_s
        self.max_life_s = max_life_s
        self.python = python
        self.ready_line = ready_line
        self.cwd = Path(cwd)  # elsewhere than the repo: `python -m` puts the folder it runs in on sys.path
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return ["timeout", "-k", "10", str(self.max_life_s), self.python, "-m", "sglang.launch_server", *self.args]

    def start(self) -> Server:
        """Boot and wait until ready. A port taken between :func:`free_port` and the server's bind
        (another process on the machine got it first) is retried on a fresh port, at most
        :data:`PORT_RETRIES` times; the log keeps every attempt."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        attempt = 0
        while True:
            t0 = time.monotonic()
            with open(self.log_path, "ab" if attempt else "wb") as log:
                self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             cwd=self.cwd, start_new_session=True)
            try:
                self._wait_ready(t0)
            except BaseException as exc:
                self.stop()
                if not isinstance(exc, ServerFailed) or attempt == PORT_RETRIES or not self._lost_its_port():
                    raise
                attempt += 1
                self._move_to(free_port())
                continue
            self.startup_s = time.monotonic() - t0
            return self

    def _lost_its_port(self) -> bool:
        return PORT_TAKEN in self.log_text() and self.proc is not None and self.proc.poll() is not None

    def _move_to(self, port: int) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"\n[launcher] port {self.port} was taken before the server bound it: again on port {port}\n")
        self.args[self.args.index("--port") + 1] = str(port)
        self.port = port

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"server exited with code {self.proc.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.tail()}")
            if time.monotonic() - t0 > self.ready_timeout_s:
                raise ServerFailed(f"server not ready after {self.ready_timeout_s:.0f} s; log {self.log_path}:\n"
                                   f"{self.tail()}")
            if self.ready_line in self.log_text() and self._healthy():
                return
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_lines(self) -> list[str]:
        return self.log_text().splitlines()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> list[int]:
        """Stop the whole process group; returns the pids that needed SIGKILL (empty on a clean stop)."""
        if self.proc is None:
            return []
        group = self.proc.pid  # start_new_session: the leader's pid is the group and session id
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while members(group) and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.2)
        late = members(group)
        for pid in late:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _signal_group(group, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while members(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        return late

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(server: Server, work: Callable[[Server], dict[str, Any]]) -> dict[str, Any]:
    """Boot ``server``, run ``work(server)`` on it, stop it: the work's results with the boot's
    ``startup_s``, the server's ``log`` lines and its ``survivors`` (processes of its group still
    alive after the stop; a clean stop leaves none)."""
    with server:
        results = work(server)
        group = server.proc.pid
    return {**results, "startup_s": server.startup_s, "log": server.log_lines(), "survivors": members(group)}


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def survivors(groups: Iterable[int]) -> list[int]:
    return [pid for group in groups for pid in members(group)]
