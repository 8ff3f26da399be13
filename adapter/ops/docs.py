"""``docs/adapters.md``, rendered from the registry (so the doc cannot drift from the table).

``python -m adapter docs`` rewrites it; ``python -m adapter docs --check`` fails when it is stale
(a test runs the check).
"""

from __future__ import annotations

from pathlib import Path

from adapter.core import env, registry

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adapters.md"
PROFILE = ROOT / ".env.tp4.example"


def _keys(switch: registry.Switch) -> str:
    parts = [f"`{k.name}` ({k.parser.allowed}" + (f"; default {k.default}" if k.default else "") + ")" for k in switch.keys]
    return "<br>".join(parts)


def render(profile: Path = PROFILE) -> str:
    lines = [
        "# Adapters",
        "",
        "Generated from `adapter/core/registry.py` by `python -m adapter docs`; do not edit by hand.",
        "Every switch is off unless its switch key (the first key listed) is set; rollback is to unset it.",
        "",
        "| switch | file | keys | wraps (hooked) | relies on (pinned, not wrapped) | what it changes | release gate | volatile "
        "| rollback |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in registry.SWITCHES:
        hooks = "<br>".join(f"`{t}`" for t in s.wraps)
        relied = "<br>".join(f"`{t}`" for t in s.relies_on) or "-"
        requires = f" Turns on: {', '.join(s.requires)}." if s.requires else ""
        role = s.gate_role
        role_text = (f"acts: {role.acts}" if role.acts
                     else f"not applicable: {role.not_applicable}" if role.not_applicable
                     else f"not in the profile: {role.not_in_profile}")
        lines.append(
            f"| `{s.name}` | `{s.module_file}` | {_keys(s)} | {hooks} | {relied} | {s.summary}.{requires} | {role_text} "
            f"| {'yes' if s.volatile else 'no'} | unset `{s.on_key.name}` |"
        )
    lines += [
        "",
        "Volatile: the switch changes no tuned shape or kernel, so its keys are left out of the autotune",
        "keep fingerprint (a toggle keeps the FlashInfer autotune cache).",
        "",
        "Keys outside the switches: "
        + ", ".join(f"`{k.name}` ({k.doc})" for k in registry.GLOBAL_KEYS)
        + ".",
        "",
    ]
    if profile.is_file():
        config = registry.resolve(env.read_env_file(str(profile)))
        lines += [
            f"## Receipts every rank must log for `{profile.name}`",
            "",
            "`python -m adapter receipts LOG... --env-file "
            f"{profile.name} --ranks N` checks these lines on every rank (and that no switch is refused):",
            "",
            "```",
            *(f"[dsv41] {s.name} installed ... rank=<rank>" for s in config.requested),
            "```",
            "",
            "A switch that decides at cache build (cone replay) first logs `[dsv41] <switch> armed ...` when its",
            "modules load, then `installed` or `refused` once the cache exists.",
            "",
        ]
    return "\n".join(lines)


def main(check: bool) -> int:
    text = render()
    if check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python -m adapter docs")
            return 1
        print(f"{DOC.relative_to(ROOT)} is up to date")
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0
