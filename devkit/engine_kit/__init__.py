"""The CPU engine kit: SGLang 0.5.23's real HTTP server on a CPU-only machine, for tests and the gate.

Never for production. Three parts:
* ``stub/sgl_kernel``: a pure-torch stand-in for the CPU build of ``sgl_kernel`` (no registry has
  it), put on the server's ``PYTHONPATH`` by the launcher only;
* :mod:`.model`: a deterministic tiny hybrid SWA model (Mellum type) with a locally built tokenizer;
* :mod:`.launcher`: starts ``python -m sglang.launch_server`` on 127.0.0.1 with the overlay on
  ``PYTHONPATH``, waits for health, and always stops the whole process group;
* :mod:`.client`: the HTTP calls the workloads make (bounded in count and time).
"""
