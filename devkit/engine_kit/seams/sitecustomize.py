"""Test seams for a kit server (never on a serving path): put this folder first on the server's
``PYTHONPATH`` (:func:`devkit.engine_kit.seams_env`) with ``KIT_SEAMS`` naming the seams, comma
separated; each is a module of this folder, imported in every process of the server before the
overlay's own ``sitecustomize`` runs as it would have:

* ``planted_leak``: the scheduler keeps ``SOAK_PLANTED_LEAK_KIB`` KiB for every generate request
  (``python -m adapter soak --plant-leak-kib``);
* ``park_probe``: on every retraction, one line with what the tree holds of the row's tokens, read
  from its nodes before the row is released (``tests/engine/test_kv_park_server.py``);
* ``hicache_reserve``: HiCache's 10 GiB host-memory reserve lowered for a kit's tiny host pools, so
  a HiCache boot does not fail on a busy machine.
"""

import importlib
import os
import runpy
from pathlib import Path

for _name in filter(None, (s.strip() for s in os.environ.get("KIT_SEAMS", "").split(","))):
    importlib.import_module(_name)

runpy.run_path(str(Path(__file__).resolve().parents[3] / "sitecustomize.py"), run_name="sitecustomize")
