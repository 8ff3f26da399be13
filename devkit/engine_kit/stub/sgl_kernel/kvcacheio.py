"""``sgl_kernel.kvcacheio`` of the stand-in: the pure-torch host <-> device KV copies HiCache calls.

One copy, in the wheel: :mod:`overlay_tools.simulate.host_copies` (``simulate`` replays HiCache's
host tier on them). The kit servers run with the repo on ``PYTHONPATH``, so this module re-exports
it; the host pool route (:mod:`sgl_kernel._route`) binds the same objects.
"""

from overlay_tools.simulate.host_copies import *  # noqa: F403  (the ops, by their kernel names)
from overlay_tools.simulate.host_copies import NOT_HERE, __all__, __getattr__  # noqa: F401
