"""Autotune keep (``DSV41_AUTOTUNE_KEEP=1``): the FlashInfer autotune cache survives boots of one launch.

What it changes: SGLang 0.5.23 hashes each rank's autotune cache file into a cross-rank digest and
drops every rank's cache when the digests differ (``_drop_diverged_autotune_cache``). Under expert
parallelism the files always differ (each rank tunes its own experts), so every boot re-draws the
MoE tactics from timing noise (sglang#40320). With this switch, a rank that saved its cache writes
a sidecar fingerprint next to it: sha256 of ``sys.argv`` and of the ``SGLANG_*``/``DSV41_*``/``NCCL_*``
environment minus the keys the registry declares volatile (plus ``SGLANG_RUN_ID``), and the sha256
of the cache bytes it saved. At the next boot a cache whose sidecar matches is "this launch's" and
only that fact enters the cross-rank digest, so ranks keep their own tactics; a cache whose
sidecar is missing, corrupt or from another launch is dropped before tuning, and a rank that does
not match makes every rank tune afresh (the stock agreement rule).

Why it is safe: a kept cache was tuned by this rank under the same arguments and the same
non-volatile environment; FlashInfer's own ``_metadata`` check still rejects a cache from another
driver, GPU or library version.

Rollback: unset ``DSV41_AUTOTUNE_KEEP``. Sidecars left behind are ignored by stock SGLang.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from adapter.core import api

SWITCH = api.handle(__name__)
SIDECAR_SUFFIX = ".dsv41-launch.json"
FINGERPRINT_PREFIXES = ("SGLANG_", "DSV41_", "NCCL_")

# Cache paths this process validated as "saved by this rank under this launch" -> fingerprint.
_same_launch: dict[str, str] = {}


def launch_fingerprint(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """sha256 of the launch: argv plus the non-volatile engine/overlay/NCCL environment."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    volatile = SWITCH.volatile_keys()
    kept = {
        k: v for k, v in sorted(environ.items()) if k.startswith(FINGERPRINT_PREFIXES) and k not in volatile
    }
    payload = json.dumps({"argv": list(argv), "env": kept}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def sidecar_path(cache_path: Path) -> Path:
    return cache_path.with_name(cache_path.name + SIDECAR_SUFFIX)


def _drop(cache_path: Path, reason: str) -> None:
    cache_path.unlink(missing_ok=True)
    sidecar_path(cache_path).unlink(missing_ok=True)
    SWITCH.event("dropped", reason=reason, cache=cache_path.name)


def admit(cache_path: Path, fingerprint: str) -> bool:
    """Keep ``cache_path`` only if its sidecar says this launch saved exactly these bytes."""
    _same_launch.pop(str(cache_path), None)
    sidecar = sidecar_path(cache_path)
    if not cache_path.is_file():
        sidecar.unlink(missing_ok=True)
        return False
    try:
        data = cache_path.read_bytes()
        if not isinstance(json.loads(data), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError):
        _drop(cache_path, "corrupt-cache")
        return False
    try:
        stamp = json.loads(sidecar.read_text())
        saved_fingerprint, saved_sha = stamp["fingerprint"], stamp["cache_sha256"]
    except FileNotFoundError:
        _drop(cache_path, "no-sidecar")
        return False
    except (OSError, ValueError, KeyError, TypeError):
        _drop(cache_path, "corrupt-sidecar")
        return False
    if saved_sha != hashlib.sha256(data).hexdigest():
        _drop(cache_path, "cache-changed-since-saved")
        return False
    if saved_fingerprint != fingerprint:
        _drop(cache_path, "launch-changed")
        return False
    _same_launch[str(cache_path)] = fingerprint
    return True


def stamp(cache_path: Path, fingerprint: str) -> None:
    """Write the sidecar for the bytes now in ``cache_path`` (atomically: tmp + rename)."""
    if not cache_path.is_file():
        return
    sha = hashlib.sha256(cache_path.read_bytes()).hexdigest()
    sidecar = sidecar_path(cache_path)
    tmp = sidecar.with_name(f"{sidecar.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "cache_sha256": sha}))
    os.replace(tmp, sidecar)


def _digest_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> str:
    """Cross-rank digest: a same-launch cache contributes only that fact (and the environment)."""
    cache_path, env = _bind_digest_args(*args, **kwargs)
    fingerprint = _same_launch.get(str(cache_path))
    if fingerprint is None or not Path(cache_path).is_file():
        return wrapped(*args, **kwargs)
    payload = json.dumps({"same_launch": fingerprint, "env": env}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _bind_digest_args(cache_path: Path, env: dict) -> tuple[Path, dict]:
    return cache_path, env


def _context_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return _kept_context(wrapped, args, kwargs)


@contextlib.contextmanager
def _kept_context(wrapped: Any, args: tuple, kwargs: dict) -> Iterator[None]:
    module = sys.modules[SWITCH.module_of("flashinfer_autotune_context")]
    if not module.envs.SGLANG_FLASHINFER_AUTOTUNE_CACHE.get():  # reuse disabled: stock
        with wrapped(*args, **kwargs):
            yield
        return
    model_runner = args[0] if args else kwargs["model_runner"]
    cache_path = Path(module.flashinfer_autotune_cache_path(model_runner))
    fingerprint = launch_fingerprint()
    admit(cache_path, fingerprint)
    with wrapped(*args, **kwargs):
        # The stock cross-rank drop has run by now: what is on disk is what gets loaded.
        reused = str(cache_path) in _same_launch and cache_path.is_file()
        yield
    stamp(cache_path, fingerprint)
    SWITCH.event("reused" if reused else "tuned and saved", cache=cache_path.name)


def install(ctx: api.SwitchContext) -> dict[str, object]:
    SWITCH.bind(ctx)
    ctx.wrap("_autotune_cache_digest", _digest_wrapper)
    ctx.wrap("flashinfer_autotune_context", _context_wrapper)
    return {"fingerprint": launch_fingerprint()[:12]}
