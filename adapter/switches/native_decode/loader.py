"""The native SWA decode module on disk: its manifest, and the loader that checks it before loading.

``runtime/build_native_decode.sh`` writes, into one folder, a ``.so`` per architecture and
``manifest.json``. The loader trusts nothing it has not checked, in this order, and refuses with a
one-line reason (:class:`LoadRefused`) at the first failure, before any byte of a ``.so`` is
loaded:

1. the device's compute capability maps to an architecture the module is built for;
2. the manifest exists, is JSON, has the expected fields, and its ``digest`` (sha256 over every
   other field) matches: an edited manifest is a tampered one;
3. the installed ``flashinfer-python`` and ``apache-tvm-ffi`` are the versions it was built
   against, and every FlashInfer source or header nvcc read still has the recorded sha256
   (the module's planner and kernels must agree with the Python policy that runs beside them);
4. the ``.so`` for the architecture exists and its sha256 is the manifest's;
5. only then it is loaded, and it must report the page size it was built for.

No torch, no SGLang here: the build script imports this module for the manifest format.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DIR = REPO_ROOT / "build" / "native_decode"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
MODULE_NAME = "dsv4_native_decode"
NATIVE_PAGE_SIZE = 256
FLASHINFER_DIST = "flashinfer-python"
TVM_FFI_DIST = "apache-tvm-ffi"
ARCH_BY_CAPABILITY = {(12, 0): "sm_120a", (12, 1): "sm_121a"}
ENTRY_POINTS = ("dsv4_native_page_decode", "native_page_size", "decode_scratch_heads")
FLASHINFER_LABEL = "{flashinfer}"
_REQUIRED = ("format", "module", "native_page_size", "flashinfer", "tvm_ffi_version", "nvcc", "flags",
             "inputs", "artifacts", "digest")  # fmt: skip


class LoadRefused(Exception):
    """The module cannot be used here; the message is one line naming what failed."""


def so_name(arch: str) -> str:
    """``sm_120a`` -> ``dsv4_native_p256_sm120a.so``."""
    return f"dsv4_native_p{NATIVE_PAGE_SIZE}_{arch.replace('_', '')}.so"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of every field but ``digest``."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def arch_for_capability(capability: tuple[int, int]) -> str:
    arch = ARCH_BY_CAPABILITY.get(tuple(capability))
    if arch is None:
        built = ", ".join(ARCH_BY_CAPABILITY.values())
        raise LoadRefused(f"unknown arch sm_{capability[0]}{capability[1]}: the module is built for {built}")
    return arch


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoadRefused(f"no manifest at {path}: build the module with runtime/build_native_decode.sh") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LoadRefused(f"manifest {path} is unreadable: {type(exc).__name__}") from None
    if not isinstance(manifest, dict) or any(key not in manifest for key in _REQUIRED):
        missing = [k for k in _REQUIRED if not isinstance(manifest, dict) or k not in manifest]
        raise LoadRefused(f"manifest {path} is malformed: missing {', '.join(missing)}")
    if manifest["digest"] != manifest_digest(manifest):
        raise LoadRefused(f"manifest {path} was modified after the build (digest mismatch)")
    if manifest["format"] != MANIFEST_FORMAT or manifest["module"] != MODULE_NAME:
        raise LoadRefused(f"manifest {path} is for {manifest['module']} format {manifest['format']}, not {MODULE_NAME}")
    if manifest["native_page_size"] != NATIVE_PAGE_SIZE:
        raise LoadRefused(f"manifest {path} is for page size {manifest['native_page_size']}, not {NATIVE_PAGE_SIZE}")
    return manifest


def _flashinfer_dir() -> Path:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise LoadRefused("flashinfer is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def check_toolchain_match(manifest: dict[str, Any], flashinfer_dir: Path | None = None) -> None:
    """The installed FlashInfer / tvm-ffi are the ones the module was built from (versions and sources)."""
    for dist, built in ((FLASHINFER_DIST, manifest["flashinfer"].get("version")), (TVM_FFI_DIST, manifest["tvm_ffi_version"])):
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = "none"
        if installed != built:
            raise LoadRefused(f"{dist} {installed} is installed but the module was built against {built}")
    root = flashinfer_dir or _flashinfer_dir()
    for label, expected in manifest["inputs"].items():
        if not label.startswith(FLASHINFER_LABEL + "/"):
            continue
        path = root / label[len(FLASHINFER_LABEL) + 1 :]
        try:
            found = sha256_file(path)
        except OSError:
            found = "missing"
        if found != expected:
            raise LoadRefused(f"FlashInfer source {label} changed since the module was built")


def verified_path(directory: Path, arch: str, manifest: dict[str, Any]) -> tuple[Path, str]:
    """The ``.so`` for ``arch`` and its sha256, after checking the file against the manifest."""
    artifact = manifest["artifacts"].get(arch)
    if not isinstance(artifact, dict) or "sha256" not in artifact:
        raise LoadRefused(f"the manifest has no module for {arch} (built: {', '.join(sorted(manifest['artifacts']))})")
    path = Path(directory) / so_name(arch)
    if artifact.get("file") != path.name:
        raise LoadRefused(f"the manifest names {artifact.get('file')!r} for {arch}, expected {path.name}")
    try:
        found = sha256_file(path)
    except OSError:
        raise LoadRefused(f"module file {path} is missing") from None
    if found != artifact["sha256"]:
        raise LoadRefused(
            f"sha256 mismatch for {path.name}: manifest {artifact['sha256'][:16]}, file {found[:16]}; not loaded"
        )
    return path, found


@dataclass(frozen=True)
class Loaded:
    module: Any  # the tvm_ffi.Module
    arch: str
    path: Path
    sha256: str
    manifest: dict[str, Any]


def _tvm_load(path: Path) -> Any:
    import tvm_ffi

    return tvm_ffi.load_module(str(path))


def load(directory: Path, arch: str, *, loader: Callable[[Path], Any] | None = None,
         flashinfer_dir: Path | None = None) -> Loaded:  # fmt: skip
    """Verify everything, then load the ``.so`` for ``arch`` (``loader`` default: ``tvm_ffi.load_module``)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_toolchain_match(manifest, flashinfer_dir)
    path, sha = verified_path(directory, arch, manifest)
    try:
        module = (loader or _tvm_load)(path)
    except Exception as exc:
        raise LoadRefused(f"loading {path.name} failed: {type(exc).__name__}: {exc}") from None
    for name in ENTRY_POINTS:
        try:
            getattr(module, name)
        except AttributeError:
            raise LoadRefused(f"{path.name} has no {name} export") from None
    page = int(module.native_page_size())
    if page != NATIVE_PAGE_SIZE:
        raise LoadRefused(f"{path.name} serves page size {page}, expected {NATIVE_PAGE_SIZE}")
    return Loaded(module, arch, path, sha, manifest)
