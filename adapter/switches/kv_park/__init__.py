"""KV parking to host RAM (``DSV41_KV_PARK=ram``).

* :mod:`adapter.switches.kv_park.engine`: the page-major copy engine and its documented byte format.
* :mod:`adapter.switches.kv_park.store`: the host store (``DSV41_KV_PARK_GIB`` budget, LRU eviction,
  device-event bookkeeping of copies in flight, failure latch).
* :mod:`adapter.switches.kv_park.regions`: which tensors of a pool make up a page.
* :mod:`adapter.switches.kv_park.switch`: the switch (retraction parks, re-admission restores); its
  docstring says what it changes, why, and how to roll back (unset ``DSV41_KV_PARK``).

Importing this package imports neither SGLang nor the switch.
"""
