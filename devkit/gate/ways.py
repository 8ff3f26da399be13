"""How the gate's servers load the overlay: the import hook (``sitecustomize.py`` on ``PYTHONPATH``,
the default) or the installed wheel as SGLang's plugin (``--via plugin``).

``plugin``: the overlay's wheel (``tools/image/build_wheel.sh``) is ``pip install``-ed into a fresh
venv beside the shared one (:mod:`devkit.testkit.wheel`), and every boot runs that venv's python
with ``SGLANG_PLUGINS=dsv41``, only the ``sgl_kernel`` stand-in on ``PYTHONPATH`` and the gate's out
folder as its working directory: no repo on ``sys.path``, so no ``sitecustomize`` fires and SGLang's
``load_plugins`` installs the switches. The Mellum kit only: the DeepSeek-V4 kit's kernel routes live
in ``devkit``, which its servers import from the repo (and with the repo on the path, the import
hook would load too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WAYS = ("import-hook", "plugin")
PLUGIN_KITS = ("mellum",)


@dataclass(frozen=True)
class Plugin:
    python: Path  # the venv's interpreter, the wheel installed
    cwd: Path  # where the servers run: anywhere but the repo

    def server_env(self, env: dict[str, str]) -> dict[str, str]:
        from devkit.engine_kit import launcher

        return {**env, "PYTHONPATH": str(launcher.STUB_PATH), "SGLANG_PLUGINS": "dsv41"}


def check(via: str, kit_name: str) -> None:
    """A clear error for a way this kit cannot boot, before any boot."""
    if via not in WAYS:
        raise ValueError(f"--via {via!r} is invalid: expected one of {', '.join(WAYS)}")
    if via == "plugin" and kit_name not in PLUGIN_KITS:
        raise ValueError(f"--via plugin with --model {kit_name} is invalid: the plugin way runs on "
                         f"{', '.join(PLUGIN_KITS)} only (the DeepSeek-V4 kit's routes are imported from the repo)")


def prepare(via: str, out: Path, say: Callable[[str], None]) -> Plugin | None:
    """None for the import hook; for the plugin, the venv with the freshly built wheel installed."""
    if via != "plugin":
        return None
    from devkit.testkit import wheel

    folder = out / "plugin"
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    built = wheel.build(folder / "dist")
    python = wheel.venv_beside(folder / "venv")
    wheel.install(python, built)
    say(f"gate: via plugin: {built.name} installed in {folder / 'venv'} (SGLANG_PLUGINS=dsv41, no repo on the path)")
    return Plugin(python, out)
