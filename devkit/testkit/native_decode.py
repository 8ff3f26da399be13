"""CPU seams for the native SWA decode switch's tests: a module folder with a valid manifest, and the
keyword arguments SGLang's DSV4 backend passes for a reference case. The stand-ins for the two pieces
with no CPU path (the compiled module's launch, FlashInfer's CUDA decode) are the DSV4 kit's own:
:mod:`devkit.engine_kit.dsv4.native_decode_stand_ins`.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import torch

from adapter.switches.native_decode import loader as ndm
from devkit.reference import dsv4_decode as ref

FAKE_SO = b"\x7fELF not a real module: the loader seam stands in for tvm_ffi.load_module\n"


def write_module_dir(directory: Path, arches: tuple[str, ...] = ("sm_120a", "sm_121a"), *,
                     payload: bytes = FAKE_SO) -> dict[str, Any]:  # fmt: skip
    """A folder shaped like the build's output: one file per arch and a manifest with a valid digest.

    The manifest records the installed FlashInfer / tvm-ffi versions and one real FlashInfer input
    (the binding source the guard's body is extracted from) with its real sha256.
    """
    directory.mkdir(parents=True, exist_ok=True)
    artifacts = {}
    for arch in arches:
        path = directory / ndm.so_name(arch)
        path.write_bytes(payload + arch.encode())
        artifacts[arch] = {"file": path.name, "sha256": ndm.sha256_file(path), "bytes": path.stat().st_size}
    binding = "data/csrc/sparse_mla_sm120/attention_binding.cu"
    flashinfer_dir = ndm._flashinfer_dir()
    manifest = {
        "format": ndm.MANIFEST_FORMAT,
        "module": ndm.MODULE_NAME,
        "native_page_size": ndm.NATIVE_PAGE_SIZE,
        "flashinfer": {"dist": ndm.FLASHINFER_DIST, "version": importlib.metadata.version(ndm.FLASHINFER_DIST)},
        "tvm_ffi_version": importlib.metadata.version(ndm.TVM_FFI_DIST),
        "nvcc": {"version": "test"},
        "flags": {"nvcc": [], "link": ["-shared", "-s"]},
        "inputs": {f"{ndm.FLASHINFER_LABEL}/{binding}": ndm.sha256_file(flashinfer_dir / binding)},
        "artifacts": artifacts,
    }
    manifest["digest"] = ndm.manifest_digest(manifest)
    (directory / ndm.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def rewrite_manifest(directory: Path, edit, *, keep_digest: bool) -> None:
    """Apply ``edit(manifest)``; with ``keep_digest`` the old digest stays (a tampered manifest)."""
    path = directory / ndm.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    if not keep_digest:
        manifest["digest"] = ndm.manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


def sglang_kwargs(case: ref.DecodeCase, *, view: torch.Tensor | None = None) -> dict[str, Any]:
    """The keyword arguments SGLang's DSV4 backend passes ``flash_mla_with_kvcache_sm120`` for a case."""
    return {
        "q": case.q.unsqueeze(1),
        "k_cache": ref.kernel_view(case.pool, ref.SWA_PAGE) if view is None else view,
        "head_dim_v": ref.DIM,
        "softmax_scale": case.sm_scale,
        "indices": case.indices.unsqueeze(1),
        "topk_length": case.topk_length,
        "attn_sink": case.attn_sink,
        "extra_k_cache": ref.kernel_view(case.extra_pool, ref.SPLIT_PAGE),
        "extra_indices_in_kvcache": case.extra_indices.unsqueeze(1),
        "extra_topk_length": case.extra_topk_length,
    }
