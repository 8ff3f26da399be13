"""Upstream drift on purpose: a temporary copy of the installed SGLang with one pinned function
changed, for boots that must refuse exactly the switch that pins it.

``drifted_sglang(workdir, target, mode)`` copies the installed ``sglang`` package (sources only,
no ``__pycache__``) into ``workdir/site/sglang`` and changes the function ``target``
(``module:qualname``, as pinned in :mod:`adapter.core.pins`) in the copy only:

* ``edit``: one comment line is added inside the function body (its behaviour is stock, its
  source hash is not);
* ``rename``: the function's ``def`` name gets a ``_drifted`` suffix (the pinned name is gone);
* ``delete``: its ``def`` line and body are replaced by nothing (the pinned name is gone).

Put ``workdir/site`` first on the server's ``PYTHONPATH`` (:func:`pythonpath_first`). The
installed package (the venv) is never written.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
from pathlib import Path

MODES = ("edit", "rename", "delete")


def _installed_function(target: str):
    from adapter.core import pins

    return inspect.unwrap(pins.object_at(target))


def drifted_sglang(workdir: str | Path, target: str, mode: str = "edit") -> Path:
    """The ``site`` folder holding the drifted copy (put it first on ``PYTHONPATH``)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {', '.join(MODES)}")
    sglang = importlib.import_module("sglang")
    installed = Path(sglang.__file__).resolve().parent
    site = Path(workdir) / "site"
    copy = site / "sglang"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    fn = _installed_function(target)
    fn = getattr(fn, "fget", fn)
    source_file = Path(inspect.getsourcefile(fn)).resolve()
    lines, first = inspect.getsourcelines(fn)
    relative = source_file.relative_to(installed)
    path = copy / relative
    text = path.read_text().splitlines(keepends=True)
    start = first - 1  # the first line of the function (decorators included)
    def_at = next(i for i in range(start, start + len(lines)) if text[i].lstrip().startswith(("def ", "async def ")))
    name = fn.__name__
    if mode == "edit":
        body_indent = next(len(ln) - len(ln.lstrip()) for ln in text[def_at + 1 :] if ln.strip())
        # After the signature: the first body line (a docstring stays first? no matter: a comment
        # is not a statement, it only changes the source text the pin hashes).
        signature_end = def_at
        while not text[signature_end].rstrip().endswith(":"):
            signature_end += 1
        text.insert(signature_end + 1, " " * body_indent + "# drifted on purpose by devkit.soak.drift\n")
    elif mode == "rename":
        text[def_at] = text[def_at].replace(f"def {name}(", f"def {name}_drifted(", 1)
    else:
        del text[start : start + len(lines)]
    path.unlink()  # a new file, whatever the copy's link structure
    path.write_text("".join(text))
    return site


def pythonpath_first(site: str | Path, pythonpath: str | None) -> str:
    return os.pathsep.join([str(site)] + ([pythonpath] if pythonpath else []))
