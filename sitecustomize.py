"""DSV41 overlay entry point, loaded by Python's site machinery when this folder is on PYTHONPATH.

With no ``DSV41_*`` variable set it does nothing and imports nothing of ``adapter``: the engine
runs stock. Otherwise it hands over to ``adapter.core.boot``, which validates the configuration and
installs the import hook that wraps pinned upstream functions when their modules load.
"""

import os

if any(key.startswith("DSV41_") for key in os.environ):
    from adapter.core import boot

    boot.install_from_environment()
