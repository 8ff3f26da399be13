"""Env parsing and the registry table: errors name the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from adapter.core import env, registry


@pytest.mark.parametrize("raw", ["abc", "0", "100", "150", "-3", "", "3.5", "33%"])
def test_a_percent_outside_1_to_99_is_refused_naming_key_value_and_range(raw):
    with pytest.raises(env.ConfigError) as err:
        env.percent()("DSV41_DECODE_YIELD", raw)
    message = str(err.value)
    assert "DSV41_DECODE_YIELD" in message and repr(raw) in message and "1..99" in message


@pytest.mark.parametrize("raw", ["1", "33", "99", " 50 "])
def test_a_percent_inside_1_to_99_parses_to_an_int(raw):
    assert env.percent()("K", raw) == int(raw)


def test_a_token_count_must_be_a_positive_multiple_of_the_page():
    tokens = env.integer(256, None, multiple_of=256, unit="tokens")
    assert tokens("DSV41_SWA_CONE_TOKENS", "8192") == 8192
    for bad in ("8000", "0", "-256", "eight"):
        with pytest.raises(env.ConfigError, match=r"DSV41_SWA_CONE_TOKENS=.*multiple of 256"):
            tokens("DSV41_SWA_CONE_TOKENS", bad)


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False)])
def test_flags_accept_the_documented_spellings(raw, value):
    assert env.flag()("DSV41_X", raw) is value


@pytest.mark.parametrize("raw", ["maybe", "2", "enable", "y"])
def test_flags_refuse_other_spellings(raw):
    with pytest.raises(env.ConfigError, match=r"DSV41_X=.*expected 1/0, true/false"):
        env.flag()("DSV41_X", raw)


def test_resolve_reports_a_bad_value_as_an_error_and_requests_nothing_for_it():
    config = registry.resolve({"DSV41_AUTOTUNE_KEEP": "maybe"})
    assert config.errors == [
        "DSV41_AUTOTUNE_KEEP='maybe' is not valid: expected 1/0, true/false, on/off, yes/no (any case)"
    ]
    assert config.requested == []


def test_an_unknown_key_warns_with_the_closest_known_key():
    config = registry.resolve({"DSV41_AUTOTUNE_KEPP": "1"})
    assert config.errors == []
    assert config.warnings == ["unknown key DSV41_AUTOTUNE_KEPP ignored; did you mean DSV41_AUTOTUNE_KEEP?"]


def test_a_switch_is_off_unless_its_switch_key_is_set_truthy():
    assert registry.resolve({}).requested == []
    assert registry.resolve({"DSV41_AUTOTUNE_KEEP": "0"}).requested == []
    assert [s.name for s in registry.resolve({"DSV41_AUTOTUNE_KEEP": "1"}).requested] == ["autotune_keep"]


def test_every_registry_record_is_complete_and_consistent():
    names = [s.name for s in registry.SWITCHES]
    assert len(names) == len(set(names))
    keys = [k.name for s in registry.SWITCHES for k in s.keys]
    assert len(keys) == len(set(keys)), "a key belongs to one switch"
    from adapter.core import pins

    for switch in registry.SWITCHES:
        assert all(k.startswith(env.PREFIX) for k in (key.name for key in switch.keys))
        assert switch.modules and switch.wraps and ":" in switch.install
        assert set(switch.requires) <= set(names)
        assert not set(switch.wraps) & set(switch.relies_on), "a target is wrapped or relied on, not both"
        assert set(switch.pinned) <= set(pins.PINS), "every wrapped or relied-on target has a pin"
        assert switch.gate_role.acts or switch.gate_role.not_applicable or switch.gate_role.not_in_profile


def test_a_switch_key_with_a_default_is_refused_so_every_switch_stays_off_unless_set():
    thin = registry.by_name("swa_thin")
    with pytest.raises(ValueError, match="DSV41_SWA_THIN has a default"):
        dataclasses.replace(thin, on_key=dataclasses.replace(thin.on_key, default="1"))


def test_option_keys_alone_turn_no_switch_on():
    options = {k.name: k.default or "1" for s in registry.SWITCHES for k in s.options}
    assert registry.resolve(options).requested == []


def test_a_gate_role_needs_exactly_one_of_acts_not_applicable_or_not_in_profile():
    with pytest.raises(ValueError, match="exactly one"):
        registry.GateRole()
    with pytest.raises(ValueError, match="exactly one"):
        registry.GateRole(acts="x", not_applicable="y")


def test_profile_files_are_read_as_docker_env_files_one_key_a_line_values_as_they_stand(tmp_path):
    profile = tmp_path / ".env"
    profile.write_text(
        "# production\n"
        "\n"
        "   # an indented comment\n"
        "LAUNCH_ARGS=--model-path /m --swa-prefix-tails 384\n"
        "  DSV41_DECODE_YIELD=33\n"
        "DSV41_SWA_CONE_TOKENS=\n"
        "DSV41_DECODE_YIELD=50\n"
    )
    assert env.read_env_file(str(profile)) == {
        "LAUNCH_ARGS": "--model-path /m --swa-prefix-tails 384", "DSV41_DECODE_YIELD": "50", "DSV41_SWA_CONE_TOKENS": ""}


@pytest.mark.parametrize(("line", "why"), [
    ('LAUNCH_ARGS="--tp-size 4" DSV41_SWA_THIN=1', "a value without quotes"),  # the old one-line shell form
    ("DSV41_SWA_THIN='1'", "a value without quotes"),
    ("DSV41_SWA_THIN=1 # on", "a value without quotes"),
    ("DSV41_SWA_THIN=$ON", "a value without quotes"),
    ("DSV41_SWA_THIN=1 ", "a value without quotes"),
    ("export DSV41_SWA_THIN=1", "a key with no blank"),
    ("DSV41_SWA_THIN", "KEY=VALUE"),
    ("=1", "a key with no blank"),
])
def test_a_profile_line_docker_and_compose_would_read_differently_is_refused_with_its_line(tmp_path, line, why):
    profile = tmp_path / ".env"
    profile.write_text(f"DSV41_DECODE_YIELD=33\n{line}\n")
    with pytest.raises(env.ConfigError, match=f"^{profile}:2=.*expected {why}"):
        env.read_env_file(str(profile))


@pytest.mark.spawns
def test_every_switch_installs_through_the_real_import_hook_in_a_fresh_engine_process():
    """All switch keys set, the engine's modules imported in a fresh process: nothing refused for a
    half-loaded module or an unreadable pin (only 'not applicable here' on this machine)."""
    import subprocess
    import sys
    from pathlib import Path

    on = {"flag": "1", "percent": "33"}
    environ = {}
    for switch in registry.SWITCHES:
        allowed = switch.on_key.parser.allowed
        environ[switch.on_key.name] = "ram" if allowed.startswith("one of") else on["percent" if "1..99" in allowed else "flag"]
    script = (
        "import importlib\n"
        "from adapter.core import boot, registry\n"
        f"state = boot.install({environ!r})\n"
        "for s in registry.SWITCHES:\n"
        "    for m in s.modules: importlib.import_module(m)\n"
        "for name, o in state.outcomes.items(): print(name, o.status, o.reason)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert set(rows) == {s.name for s in registry.SWITCHES}
    assert all(row.startswith(("installed", "armed", "n/a")) for row in rows.values()), rows


def test_the_native_decode_stand_in_key_takes_any_function_name_and_names_no_devkit_module():
    """The serving registry names no test module: the tests supply the stand-in's ``module:function``."""
    key = registry.all_keys()["DSV41_NATIVE_DECODE_STANDIN"]
    assert key.parser("K", " tests.kit.route:served ") == "tests.kit.route:served"
    for bad in ("devkit.engine_kit.dsv4.native_decode_route", "route:", ":served", "a-b:c", "a..b:c"):
        with pytest.raises(env.ConfigError, match=r"expected a package\.module:function name"):
            key.parser("DSV41_NATIVE_DECODE_STANDIN", bad)
    assert "devkit" not in (Path(registry.__file__)).read_text()
