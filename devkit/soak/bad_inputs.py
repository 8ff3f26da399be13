"""Every bad input tried, with the answer it gets: the table of ``docs/reliability.md``.

``python -m devkit.soak.bad_inputs [--write]`` runs each case of :data:`CASES` for real (the CLI
in this process, with its stdout and stderr captured; the kit's validators called directly) and
prints the table (``--write``: replaces the table between the markers of docs/reliability.md).
``tests/unit/test_bad_inputs_table.py`` runs them again and asserts the page still says what they do.

A case's answer is its exit status and its first diagnostic line (``error:``, ``problem:``,
``warning:``, ``missing:``, an exception's last line), trimmed of the run's temporary folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
BEGIN, END = "<!-- bad-inputs:begin (generated: python -m devkit.soak.bad_inputs --write) -->", "<!-- bad-inputs:end -->"
GOOD_LOG = "[dsv41] swa_thin installed rank=tp0\n[dsv41] fast_tree_core installed rank=tp0\n"


@dataclass(frozen=True)
class Case:
    kind: str  # env value | profile file | receipts log | CLI argument | model folder
    what: str  # the input, as the table shows it
    argv: tuple[str, ...] = ()  # python -m adapter <argv>; {dir} is the case's folder
    files: dict[str, str | bytes] = field(default_factory=dict)  # written into {dir} first
    call: Callable[[], object] | None = None  # instead of argv: a kit validator


def _env(*lines: str) -> dict[str, str]:
    return {"p.env": "\n".join(lines) + "\n"}


def _check(*lines: str, what: str | None = None, kind: str = "env value") -> Case:
    return Case(kind, what or " ".join(lines), ("check", "--env-file", "{dir}/p.env"), _env(*lines))


def _model_spec(**kw):
    from devkit.engine_kit import model

    return model.ModelSpec(**kw).validate()


def _server_args(**kw):
    from devkit.engine_kit import launcher

    return launcher.server_args("/m", **{"port": 1, **kw})


def _profile_key(key: str):
    from devkit.engine_kit import launcher

    return launcher.child_env({key: "1"})


def _model_dir_is_a_file():
    from devkit.engine_kit import model

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        path.write_text("not a folder")
        return model.make_model(path)


CASES: tuple[Case, ...] = (
    _check("DSV41_DECODE_YIELD=150"),
    _check("DSV41_DECODE_YIELD=0"),
    _check("DSV41_DECODE_YIELD=half"),
    _check("DSV41_SWA_THIN=maybe"),
    _check("DSV41_KV_PARK=disk"),
    _check("DSV41_KV_PARK=ram", "DSV41_KV_PARK_GIB=0"),
    _check("DSV41_KV_PARK=ram", "DSV41_KV_PARK_GIB=5000"),
    _check("DSV41_SWA_CONE_REPLAY=1", "DSV41_SWA_CONE_TOKENS=-64"),
    _check("DSV41_SWA_CONE_REPLAY=1", "DSV41_SWA_CONE_TOKENS=8k"),
    _check("DSV41_DECODE_YIELD=50", "DSV41_DECODE_YIELD_STEP_US=-5"),
    _check("DSV41_SWA_NATIVE_DECODE=1", "DSV41_NATIVE_DECODE_DIR=build/native"),
    _check("DSV41_STRICT=2"),
    _check("DSV41_DEBUG_LOG=verbose"),
    _check("DSV41_SWA_TIHN=1", what="DSV41_SWA_TIHN=1 (a typo of a switch key, alone)"),
    Case("profile file", "--env-file naming a file that does not exist", ("check", "--env-file", "{dir}/nope.env")),
    Case("profile file", "an unbalanced quote: DSV41_SWA_THIN='1", ("check", "--env-file", "{dir}/p.env"),
         _env("DSV41_SWA_THIN='1")),
    Case("profile file", 'a shell line of several keys: LAUNCH_ARGS="--tp-size 4" DSV41_SWA_THIN=1',
         ("check", "--env-file", "{dir}/p.env"), _env('LAUNCH_ARGS="--tp-size 4" DSV41_SWA_THIN=1')),
    Case("profile file", "a folder instead of a file", ("check", "--env-file", "{dir}")),
    Case("profile file", "bytes that are not UTF-8", ("check", "--env-file", "{dir}/p.env"),
         {"p.env": b"DSV41_SWA_THIN=\xff\xfe\n"}),
    Case("receipts log", "a log that does not exist", ("receipts", "{dir}/nope.log", "--env-file", "{dir}/p.env",
                                                       "--ranks", "1"), _env("DSV41_SWA_THIN=1")),
    Case("receipts log", "an empty log", ("receipts", "{dir}/boot.log", "--env-file", "{dir}/p.env", "--ranks", "1"),
         {**_env("DSV41_SWA_THIN=1"), "boot.log": ""}),
    Case("receipts log", "one rank's log, --ranks 2", ("receipts", "{dir}/boot.log", "--env-file", "{dir}/p.env",
                                                       "--ranks", "2"), {**_env("DSV41_SWA_THIN=1"), "boot.log": GOOD_LOG}),
    Case("receipts log", "a log cut inside the last receipt", ("receipts", "{dir}/boot.log", "--env-file", "{dir}/p.env",
                                                               "--ranks", "1"),
         {**_env("DSV41_SWA_THIN=1"), "boot.log": GOOD_LOG[:60]}),
    Case("receipts log", "--ranks 0", ("receipts", "{dir}/boot.log", "--env-file", "{dir}/p.env", "--ranks", "0"),
         {**_env("DSV41_SWA_THIN=1"), "boot.log": GOOD_LOG}),
    Case("receipts log", "--ranks two", ("receipts", "{dir}/boot.log", "--env-file", "{dir}/p.env", "--ranks", "two"),
         {**_env("DSV41_SWA_THIN=1"), "boot.log": GOOD_LOG}),
    Case("receipts log", "--env-file left out", ("receipts", "{dir}/boot.log", "--ranks", "1"), {"boot.log": GOOD_LOG}),
    Case("CLI argument", "an unknown command: frobnicate", ("frobnicate",)),
    Case("CLI argument", "bench nosuch", ("bench", "nosuch")),
    Case("CLI argument", "gate --without nosuch", ("gate", "--without", "nosuch")),
    Case("CLI argument", "soak --model llama", ("soak", "--model", "llama")),
    Case("CLI argument", "soak --minutes 0", ("soak", "--minutes", "0")),
    Case("CLI argument", "soak --minutes ten", ("soak", "--minutes", "ten")),
    Case("CLI argument", "soak --stock-minutes -1", ("soak", "--stock-minutes", "-1")),
    Case("CLI argument", "simulate: a trace line without hash_ids", ("simulate", "{dir}/t.jsonl"),
         {"t.jsonl": '{"timestamp": 0, "input_length": 512, "output_length": 4}\n'}),
    Case("CLI argument", "simulate: a trace that does not exist", ("simulate", "{dir}/nope.jsonl")),
    Case("CLI argument", "simulate --share 2", ("simulate", "{dir}/t.jsonl", "--share", "2"), {"t.jsonl": ""}),
    Case("CLI argument", "simulate --policies nosuch", ("simulate", "{dir}/t.jsonl", "--policies", "nosuch"),
         {"t.jsonl": ""}),
    Case("model folder", "ModelSpec(window=0)", call=lambda: _model_spec(window=0)),
    Case("model folder", "ModelSpec(layers=3)", call=lambda: _model_spec(layers=3)),
    Case("model folder", "ModelSpec(vocab=100)", call=lambda: _model_spec(vocab=100)),
    Case("model folder", "ModelSpec(dtype='float16')", call=lambda: _model_spec(dtype="float16")),
    Case("model folder", "make_model(out) where out is a file", call=_model_dir_is_a_file),
    Case("model folder", "server_args(chunk=8)", call=lambda: _server_args(chunk=8)),
    Case("model folder", "server_args(swa_ratio=1.5)", call=lambda: _server_args(swa_ratio=1.5)),
    Case("model folder", "a kit profile holding SGLANG_TEST_RETRACT", call=lambda: _profile_key("SGLANG_TEST_RETRACT")),
)


def _first_diagnostic(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in (r"^python -m adapter( [a-z-]+)?: error: ", r"^error: ", r"^problem: ", r"^missing: ", r"^warning: ",
                    r"^uncaught ", r"^[A-Za-z.]*(Error|Exception): "):
        for ln in lines:
            if re.match(pattern, ln):
                return ln
    return lines[-1] if lines else "(no output)"


def run_case(case: Case) -> tuple[int, str]:
    """(exit status, first diagnostic line) of one case, run for real."""
    from adapter.ops import cli

    with tempfile.TemporaryDirectory(prefix="bad-input-") as tmp:
        for name, content in case.files.items():
            path = Path(tmp) / name
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        out, err = io.StringIO(), io.StringIO()
        saved = dict(os.environ)
        rc = 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                if case.call is not None:
                    case.call()
                else:
                    rc = cli.main([a.replace("{dir}", tmp) for a in case.argv])
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:  # what the caller sees: the exception's last line
            rc = 1
            # From the CLI it is an uncaught exception: Python prints a traceback, exit status 1.
            prefix = "" if case.call is not None else "uncaught (traceback): "
            err.write(prefix + "".join(traceback.format_exception_only(type(exc), exc)))
        finally:
            os.environ.clear()
            os.environ.update(saved)
            from adapter.core import boot

            boot.uninstall()
        answer = _first_diagnostic(err.getvalue() + "\n" + out.getvalue() if case.call is not None or rc == 2
                                   else out.getvalue() + "\n" + err.getvalue())
        answer = re.sub(r"/tmp/tmp\w+", "<tmp>", answer.replace(tmp, "<dir>"))
        return rc, " ".join(answer.split())


def table(results: list[tuple[Case, int, str]]) -> str:
    rows = ["| kind | input | exit | answer |", "|---|---|---|---|"]
    for case, rc, answer in results:
        cell = answer.replace("|", "\\|")
        rows.append(f"| {case.kind} | `{case.what}` | {rc} | {cell} |")
    return "\n".join(rows)


def run_all() -> list[tuple[Case, int, str]]:
    return [(case, *run_case(case)) for case in CASES]


def write(text: str, doc: Path = DOC) -> None:
    page = doc.read_text()
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    doc.write_text(page[:start] + "\n" + text + "\n" + page[end:])


def documented(doc: Path = DOC) -> str:
    page = doc.read_text()
    return page[page.index(BEGIN) + len(BEGIN) : page.index(END)].strip()


if __name__ == "__main__":
    rendered = table(run_all())
    if "--write" in sys.argv[1:]:
        write(rendered)
    print(rendered)
