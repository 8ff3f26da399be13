"""Build the native SWA decode module (``DSV41_SWA_NATIVE_DECODE``) from the installed FlashInfer.

Compiles a decode-only TVM-FFI module per architecture (``sm_120a``, ``sm_121a``) from three
translation units:

* ``runtime/dsv4_native_decode.cu``: the project's guard (DSV4, 256-token pages only);
* ``flashinfer/data/csrc/sparse_mla_sm120/decode_dispatch.cu``: the stock decode kernel instances;
* ``flashinfer/data/csrc/sparse_mla_sm120/attention_resolve.cu``: the stock planner.

FlashInfer's files are read from the installed ``flashinfer-python`` package at build time and
never committed; the host body of the stock ``SparseMlaSm120DecodeDsv4`` is extracted from the
installed ``attention_binding.cu`` into the build folder. The flags are FlashInfer 0.7.2's own JIT
flags for this module. Two things make a rebuild byte-identical: the link strips symbols (``-s``:
nvcc puts its ``tmpxft_<pid>`` temp names into host symbols) and ``-fmacro-prefix-map`` turns the
absolute paths that ``__FILE__`` bakes into the error messages into fixed labels.

Output (``--out``, default ``build/native_decode``, or ``DSV41_NATIVE_DECODE_DIR``, the
folder the switch loads from): ``dsv4_native_p256_sm120a.so``, ``dsv4_native_p256_sm121a.so`` and ``manifest.json``
(FlashInfer version, sha256 of every input file nvcc read, nvcc version and flags, sha256 of each
``.so``, and a digest over all of it). The build ends by loading each ``.so`` through the switch's
own loader (``adapter/switches/native_decode/loader.py``: manifest digest, FlashInfer sources, sha256, then
``tvm_ffi.load_module``, which needs no GPU) and checking that DSV4 pages are a runtime argument.

Usage: ``runtime/build_native_decode.sh [--out DIR] [--arch 120a] [--jobs N]`` (what the
Dockerfiles and CI run). Exit status 0 only when every requested architecture was built.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

RUNTIME_DIR = Path(__file__).resolve().parent
REPO_ROOT = RUNTIME_DIR.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from adapter.switches.native_decode.loader import (  # noqa: E402  (the manifest format is the loader's)
    DEFAULT_DIR,
    FLASHINFER_DIST,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MODULE_NAME,
    NATIVE_PAGE_SIZE,
    manifest_digest,
    sha256_file,
    so_name,
)

OUT_ENV = "DSV41_NATIVE_DECODE_DIR"  # the switch's option key: the loader reads the same folder
FLASHINFER_VERSION = "0.7.2"  # the version SGLang 0.5.23 pins; the extraction below is written for it
ARCHES = ("120a", "121a")
GUARD_SOURCE = RUNTIME_DIR / "dsv4_native_decode.cu"
STOCK_SOURCES = ("decode_dispatch.cu", "attention_resolve.cu")  # heaviest first (scheduling)
BINDING_SOURCE = "attention_binding.cu"
STOCK_BODY_NAME = "SparseMlaSm120DecodeDsv4"
RENAMED_BODY_NAME = "StockDecodeDsv4Body"
BODY_FILE = "decode_dsv4_body.inc"

# FlashInfer 0.7.2's nvcc options for sparse_mla_sm120 (flashinfer/jit/mla.py + jit/core.py), in
# its order; include paths are added per build from the installed packages.
NVCC_OPTIONS = (
    "-DPy_LIMITED_API=0x03090000",
    "-D_GLIBCXX_USE_CXX11_ABI=1",
    "--compiler-options=-fPIC",
    "--expt-relaxed-constexpr",
    "-static-global-template-stub=false",
    "-DFLASHINFER_ENABLE_FP8_E8M0",
    "-DFLASHINFER_ENABLE_FP4_E2M1",
    "-std=c++17",
    "--threads=1",
    "-use_fast_math",
    "-Xfatbin=-compress-all",
    "--compress-mode=size",
    "-DFLASHINFER_ENABLE_F16",
    "-DFLASHINFER_ENABLE_BF16",
    "-DFLASHINFER_ENABLE_FP8_E4M3",
    "-DFLASHINFER_ENABLE_FP8_E5M2",
    "-DNDEBUG",
    "-O3",
)
LINK_OPTIONS = ("-shared", "-s")


class BuildError(RuntimeError):
    """The module cannot be built here; the message says what is missing or wrong."""


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    cuda_home: Path
    host_cxx: str
    flashinfer: Path  # the installed package directory
    flashinfer_version: str
    tvm_ffi: Path
    python_include: Path

    @property
    def csrc(self) -> Path:
        return self.flashinfer / "data" / "csrc" / "sparse_mla_sm120"

    def roots(self, out: Path) -> list[tuple[Path, str]]:
        """Path prefixes -> labels (for ``__FILE__`` and the manifest's keys), in a fixed order.

        Every path is resolved (the flags use the same resolved paths), so no root is a string
        prefix of another unless the folders nest, which ``build`` refuses.
        """
        return [
            (self.flashinfer, "flashinfer"),
            (self.tvm_ffi, "tvm_ffi"),
            (self.python_include, "python-include"),
            (self.cuda_home, "cuda"),
            (out / "src", "generated"),
            (RUNTIME_DIR, "runtime"),
        ]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(f"package {name!r} is not installed in {sys.prefix}")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def find_toolchain(nvcc: str | None = None) -> Toolchain:
    nvcc = nvcc or os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).is_file():
        raise BuildError(f"nvcc not found (looked at {nvcc}); set NVCC or put nvcc on PATH")
    cuda_home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda").resolve()
    if not (cuda_home / "include" / "cuda_runtime.h").is_file():
        raise BuildError(f"CUDA headers not found under {cuda_home}; set CUDA_HOME")
    host_cxx = os.environ.get("CXX") or shutil.which("c++") or ""
    if not host_cxx:
        raise BuildError("no host C++ compiler (c++) on PATH; set CXX")
    version = importlib.metadata.version(FLASHINFER_DIST)
    if version != FLASHINFER_VERSION:
        raise BuildError(f"{FLASHINFER_DIST} {version} is installed; this recipe builds from {FLASHINFER_VERSION}")
    flashinfer = _package_dir("flashinfer")
    python_include = Path(sysconfig.get_paths()["include"]).resolve()
    chain = Toolchain(nvcc, cuda_home, host_cxx, flashinfer, version, _package_dir("tvm_ffi"), python_include)
    for source in (*STOCK_SOURCES, BINDING_SOURCE):
        if not (chain.csrc / source).is_file():
            raise BuildError(f"{chain.csrc / source} is missing from the installed {FLASHINFER_DIST}")
    return chain


def tool_version(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    return result.stdout.strip()


# -- extraction of the stock host body -------------------------------------------------------------

_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|[{};]', re.S)


def extract_stock_body(binding_source: str) -> str:
    """The definition of ``SparseMlaSm120DecodeDsv4`` (signature and body), renamed and ``static``.

    Braces are matched outside comments and string/char literals; a declaration (``;`` before any
    ``{``) is skipped. Exactly one definition must exist: anything else means the installed file
    is not the one this recipe was written for.
    """
    definitions = []
    for start in (m.start() for m in re.finditer(rf"^void {STOCK_BODY_NAME}\(", binding_source, re.M)):
        depth = 0
        for token in _TOKEN.finditer(binding_source, start):
            text = token.group()
            if text == ";" and depth == 0:
                break  # a declaration
            if text == "{":
                depth += 1
            elif text == "}":
                depth -= 1
                if depth == 0:
                    definitions.append(binding_source[start : token.end()])
                    break
    if len(definitions) != 1:
        raise BuildError(
            f"{BINDING_SOURCE}: expected one definition of {STOCK_BODY_NAME}, found {len(definitions)}"
        )
    body = definitions[0].replace(f"void {STOCK_BODY_NAME}(", f"static void {RENAMED_BODY_NAME}(", 1)
    if STOCK_BODY_NAME in body:
        raise BuildError(f"{BINDING_SOURCE}: {STOCK_BODY_NAME} refers to itself; the extraction does not fit")
    return body


def write_body(chain: Toolchain, out: Path) -> Path:
    source = chain.csrc / BINDING_SOURCE
    text = source.read_text(encoding="utf-8")
    body = extract_stock_body(text)
    target = out / "src" / BODY_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"// Generated by runtime/build_native_decode.py from the installed {FLASHINFER_DIST} "
        f"{chain.flashinfer_version}\n// data/csrc/sparse_mla_sm120/{BINDING_SOURCE} "
        f"(sha256 {hashlib.sha256(text.encode()).hexdigest()}); not committed.\n"
    )
    target.write_text(header + body + "\n", encoding="utf-8")
    return target


# -- compile and link ----------------------------------------------------------------------------------


def nvcc_flags(chain: Toolchain, out: Path) -> list[str]:
    fi = chain.flashinfer / "data"
    includes = [
        f"-I{fi / 'cccl' / 'cub'}",
        f"-I{fi / 'cccl' / 'libcudacxx' / 'include'}",
        f"-I{fi / 'cccl' / 'thrust'}",
        f"-I{out / 'src'}",
        "-isystem", str(chain.python_include),
        "-isystem", str(chain.cuda_home / "include"),
        "-isystem", str(chain.tvm_ffi / "include"),
        "-isystem", str(fi / "include"),
        "-isystem", str(fi / "csrc"),
        "-isystem", str(fi / "cutlass" / "include"),
        "-isystem", str(fi / "cutlass" / "tools" / "util" / "include"),
        "-isystem", str(fi / "spdlog" / "include"),
    ]  # fmt: skip
    prefix_maps = [f"--compiler-options=-fmacro-prefix-map={path}={label}" for path, label in chain.roots(out)]
    return [*includes, *NVCC_OPTIONS, *prefix_maps]


def portable(text: str, chain: Toolchain, out: Path) -> str:
    """Replace machine paths with their labels (the manifest must not depend on where it was built)."""
    for path, label in chain.roots(out):
        text = text.replace(str(path), f"{{{label}}}")
    return text


@dataclass(frozen=True)
class Job:
    arch: str
    source: Path
    obj: Path

    @property
    def depfile(self) -> Path:
        return self.obj.with_suffix(".d")


def _compile(chain: Toolchain, flags: list[str], job: Job) -> float:
    job.obj.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        chain.nvcc,
        "--generate-dependencies-with-compile",
        "--dependency-output",
        str(job.depfile),
        *flags,
        f"-gencode=arch=compute_{job.arch},code=sm_{job.arch}",
        "-c",
        str(job.source),
        "-o",
        str(job.obj),
    ]
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-15:]
        raise BuildError(f"nvcc failed on {job.source.name} for sm_{job.arch}:\n" + "\n".join(tail))
    return time.monotonic() - started


def read_depfile(path: Path) -> list[Path]:
    text = path.read_text().replace("\\\n", " ")
    _, _, deps = text.partition(":")
    return [Path(p) for p in deps.split()]


def build(out: Path, arches: tuple[str, ...] = ARCHES, jobs: int | None = None, nvcc: str | None = None,
          log=print) -> dict:
    """Build every arch into ``out`` and write the manifest; returns the manifest."""
    out = out.resolve()
    chain = find_toolchain(nvcc)
    for arch in arches:
        if arch not in ARCHES:
            raise BuildError(f"unknown arch {arch!r}: this module is built for {', '.join(ARCHES)}")
    roots = [str(path) + os.sep for path, _ in chain.roots(out)]
    if any(a != b and a.startswith(b) for a in roots for b in roots):
        raise BuildError(f"the output folder {out} must not lie inside another input folder ({', '.join(roots)})")
    out.mkdir(parents=True, exist_ok=True)
    body = write_body(chain, out)
    flags = nvcc_flags(chain, out)
    work = []
    for arch in arches:
        objs = out / "obj" / f"sm{arch}"
        work += [Job(arch, chain.csrc / name, objs / name.replace(".cu", ".o")) for name in STOCK_SOURCES]
        work.append(Job(arch, GUARD_SOURCE, objs / "dsv4_native_decode.o"))
    work.sort(key=lambda j: (STOCK_SOURCES.index(j.source.name) if j.source.name in STOCK_SOURCES else 9, j.arch))
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        seconds = dict(zip(work, pool.map(lambda j: _compile(chain, flags, j), work)))
    compiled = time.monotonic()
    artifacts = {}
    for arch in arches:
        objs = [j.obj for j in work if j.arch == arch]
        objs.sort(key=lambda p: p.name)  # link order fixed: the .so bytes depend on it
        target = out / so_name(f"sm_{arch}")
        argv = [chain.host_cxx, *map(str, objs), *LINK_OPTIONS, f"-L{chain.cuda_home / 'lib64'}", "-lcudart",
                "-o", str(target)]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"link failed for sm_{arch}: {result.stderr.strip()[-2000:]}")
        artifacts[f"sm_{arch}"] = {"file": target.name, "sha256": sha256_file(target), "bytes": target.stat().st_size}
    inputs: dict[str, str] = {}
    for job in work:
        for dep in read_depfile(job.depfile):
            inputs.setdefault(portable(str(dep.resolve()), chain, out), sha256_file(dep))
    manifest = {
        "format": MANIFEST_FORMAT,
        "module": MODULE_NAME,
        "native_page_size": NATIVE_PAGE_SIZE,
        "flashinfer": {"dist": FLASHINFER_DIST, "version": chain.flashinfer_version},
        "tvm_ffi_version": importlib.metadata.version("apache-tvm-ffi"),
        "nvcc": {"version": tool_version([chain.nvcc, "--version"]).splitlines()[-1]},
        "host_cxx": tool_version([chain.host_cxx, "--version"]).splitlines()[0],
        "flags": {
            "nvcc": [portable(f, chain, out) for f in flags],
            "gencode": {f"sm_{a}": f"-gencode=arch=compute_{a},code=sm_{a}" for a in arches},
            "link": [*LINK_OPTIONS, "-L{cuda}/lib64", "-lcudart"],
        },
        "sources": {
            "guard": portable(str(GUARD_SOURCE), chain, out),
            "stock": [portable(str(chain.csrc / s), chain, out) for s in STOCK_SOURCES],
            "extracted_body": {
                "from": portable(str(chain.csrc / BINDING_SOURCE), chain, out),
                "sha256": sha256_file(chain.csrc / BINDING_SOURCE),
                "to": portable(str(body), chain, out),
            },
        },
        "inputs": dict(sorted(inputs.items())),
        "artifacts": artifacts,
    }
    manifest["digest"] = manifest_digest(manifest)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    verify(out, arches)
    linked = time.monotonic()
    for job in work:
        log(f"  {job.source.name:<24} sm_{job.arch}  {seconds[job]:6.1f} s")
    log(f"compile {compiled - started:.1f} s, link+manifest+verify {linked - compiled:.1f} s, "
        f"total {linked - started:.1f} s")
    for arch, art in artifacts.items():
        log(f"{arch}: {art['file']} {art['bytes']} B sha256 {art['sha256']}")
    return manifest


def verify(out: Path, arches: tuple[str, ...]) -> None:
    """Load each built module the way the switch does (manifest, sha256, then tvm-ffi; no GPU needed)."""
    from adapter.switches.native_decode.loader import LoadRefused, load

    for arch in arches:
        try:
            module = load(out, f"sm_{arch}").module
        except LoadRefused as exc:
            raise BuildError(f"the built module for sm_{arch} does not pass the loader: {exc}") from None
        if dict(module.format_info(1)).get("runtime_page") != 1 or list(module.main_page_sizes(1)):
            raise BuildError(f"sm_{arch}: FlashInfer's DSV4 page size is not a runtime argument in this build")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(OUT_ENV) or DEFAULT_DIR))
    parser.add_argument("--arch", action="append", choices=ARCHES, help="default: all of " + ", ".join(ARCHES))
    parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)")
    parser.add_argument("--nvcc", default=None)
    args = parser.parse_args(argv)
    try:
        build(args.out, tuple(args.arch or ARCHES), args.jobs, args.nvcc)
    except BuildError as exc:
        print(f"build_native_decode: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out.resolve() / MANIFEST_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
