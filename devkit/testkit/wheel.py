"""The overlay's wheel (``tools/image/build_wheel.sh``) and a throwaway venv to ``pip install`` it into.

The venv has no packages of its own: a ``.pth`` file in its site-packages names this interpreter's
site-packages folders, so SGLang, torch, wrapt and pip come from the shared venv (nothing is installed
there), while what pip installs lands in the new venv, ahead of them on ``sys.path``. Making one
takes well under a second; installing the wheel a few seconds.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def build(out: Path, python: str = sys.executable) -> Path:
    """Build the wheel into ``out`` with the repo's image script; returns its path."""
    done = subprocess.run(["bash", str(REPO_ROOT / "tools/image/build_wheel.sh"), str(out)],
                          env={**os.environ, "PYTHON": python}, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"build_wheel.sh failed ({done.returncode}): {done.stderr[-2000:]}")
    (wheel,) = Path(out).glob("dsv41_overlay-*.whl")
    return wheel


def venv_beside(folder: Path) -> Path:
    """A venv at ``folder`` that sees this interpreter's packages after its own; returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter this venv was made from
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = Path(folder) / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(purelib, "_shared_venv.pth").write_text("".join(f"{p}\n" for p in ours if Path(p).is_dir()))
    return python


def install(python: Path, wheel: Path) -> None:
    """``pip install`` the wheel into that venv only (no index, no dependencies: they are there)."""
    subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index",
                    "--no-deps", str(wheel)], check=True, timeout=300)
