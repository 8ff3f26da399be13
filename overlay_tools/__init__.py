"""The operator tools: commands an operator runs beside a fleet, off the serving path, installed
with the wheel (``pip install dsv41-overlay[tools]``) so that no checkout is needed.

What belongs here: a tool that reads a profile, a trace or a fleet's logs and runs SGLang's real
classes in its own process (``python -m adapter simulate``: :mod:`.simulate`, with the cache kit,
the cone's turn steps, the SWA pool formula and HiCache's CPU host route it replays on, which the
checkout's test kit and engine kit build on). What does not: anything a serving process loads (``adapter.core``,
``adapter.switches`` never import this package), and anything that boots the CPU engine kits or
their ``sgl_kernel`` stand-in (that is ``devkit``, which this package never imports; so ``soak``
stays there: docs/design.md). import-linter contracts in ``pyproject.toml`` hold both rules.
"""
