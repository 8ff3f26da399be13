"""SGLang's own benchmark client (``python -m sglang.benchmark.serving``) kept in one process for
many runs.

The client's imports take longer than a run of the kit's chat traffic (transformers, the datasets
it can generate: 15-20 s on 2 cores against a 2-6 s run), so a bench with one client run per server
boot would spend most of its time importing. :class:`ServingClient` starts one process that
imports the client while the first server boots, then runs the client's command line once per
request, exactly as ``python -m sglang.benchmark.serving ARGS`` would (``runpy`` executes the module
as ``__main__`` with ``sys.argv`` set: the same code path, no call into its functions).

Protocol on the process's stdin / stdout: one JSON object a line, ``{"argv": [...], "log": PATH,
"routing_run": NAME or null}`` in, ``{"rc": N}`` out once the run ended; the run's own stdout and
stderr go to ``log``.

Routing keys: with ``--gsp-send-routing-key`` the client keys each group
``{uuid4().hex[:8]}_{now:%Y%m%d%H%M%S}_{group}`` (``benchmark/datasets/generated_shared_prefix.py``:
``run_random_str``, ``run_start_timestamp``), new every run, so two runs' groups land on other
positions of a router's hash ring. A run given ``routing_run`` keys its groups
``{routing_run[:8]}_{routing_run}_{group}`` instead (the dataset module's ``uuid`` and ``datetime`` names
stand in for that run only), so runs that should place alike get the same keys;
:func:`routing_key` is what a group's key then is, for the caller to check in what was sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import selectors
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

MODULE = "sglang.benchmark.serving"
CHECKOUT = Path(__file__).resolve().parents[2]  # this module runs as ``-m`` from the caller's cwd


class ServingClient:
    """One client process (``env``, ``cwd``: as for the command line); :meth:`run` one run of it."""

    def __init__(self, env: dict[str, str], cwd: Path):
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=env, cwd=cwd)

    def run(self, argv: list[str], log: Path, timeout_s: float, routing_run: str | None = None) -> int:
        """The client's command line ``argv`` (without the module); its output goes to ``log``;
        ``routing_run``: the run's routing keys (the module's docstring).
        Returns its exit status; raises TimeoutError past ``timeout_s`` (the process is killed)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"argv": argv, "log": str(log), "routing_run": routing_run}) + "\n")
        self._proc.stdin.flush()
        reply = _readline(self._proc, timeout_s)
        if not reply:
            raise RuntimeError(f"the client process exited ({self._proc.poll()}); its last run's output is in {log}")
        return int(json.loads(reply)["rc"])

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> ServingClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def client_args(base_url: str, tokenizer: Path, out_file: Path, traffic: dict[str, Any], seed: int = 1) -> list[str]:
    """SGLang's own benchmark client's arguments, multi-turn chat on the generated-shared-prefix
    dataset (``traffic``: groups, per_group, system, question, output, turns, rate, and
    optionally range_ratio)."""
    return [
        "--backend", "sglang-oai-chat", "--base-url", base_url,
        "--model", str(tokenizer), "--tokenizer", str(tokenizer),
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(traffic["groups"]), "--gsp-prompts-per-group", str(traffic["per_group"]),
        "--gsp-system-prompt-len", str(traffic["system"]), "--gsp-question-len", str(traffic["question"]),
        "--gsp-output-len", str(traffic["output"]), "--gsp-num-turns", str(traffic["turns"]),
        "--request-rate", str(traffic["rate"]), "--seed", str(seed), "--warmup-requests", "0",
        "--disable-tqdm", "--output-file", str(out_file), "--output-details",
        *(("--gsp-range-ratio", str(traffic["range_ratio"])) if "range_ratio" in traffic else ()),
    ]


def client_env() -> dict[str, str]:
    """No network: the tokenizer is the kit's folder, and the Hub is never asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    return env


GSP_MODULE = "sglang.benchmark.datasets.generated_shared_prefix"


def routing_key(routing_run: str, group: int) -> str:
    """The routing key of ``group`` in a run given ``routing_run``."""
    return f"{routing_run[:8]}_{routing_run}_{group}"


@contextlib.contextmanager
def _routing_keys_of(routing_run: str | None):
    """The dataset module's ``uuid.uuid4().hex`` and ``datetime.now().strftime(...)`` both read
    ``routing_run`` while the run lasts (nothing else in that module reads either name)."""
    if routing_run is None:
        yield
        return
    import importlib
    import types

    gsp = importlib.import_module(GSP_MODULE)
    named = {"uuid": types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex=routing_run)),
             "datetime": types.SimpleNamespace(now=lambda: types.SimpleNamespace(strftime=lambda _fmt: routing_run))}
    saved = {name: getattr(gsp, name) for name in named}
    for name, value in named.items():
        setattr(gsp, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gsp, name, value)


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            proc.kill()
            proc.wait()
            raise TimeoutError(f"the client run took more than {timeout_s:.0f} s")
    return proc.stdout.readline()


def _serve() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        __import__(MODULE)  # the imports, once, while the caller boots its server
    for line in sys.stdin:
        request = json.loads(line)
        with open(request["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            rc = 0
            sys.argv = [MODULE, *request["argv"]]
            try:
                with _routing_keys_of(request.get("routing_run")):
                    runpy.run_module(MODULE, run_name="__main__", alter_sys=False)
            except SystemExit as exc:  # argparse's errors, or the client's own exit
                rc = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # the run failed; the process serves the next one
                traceback.print_exc()
                rc = 1
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    _serve()
