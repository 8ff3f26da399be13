"""The shipped profiles against the registry (the reference fleet's `.env.tp4.example`, the
datacenter `.env.h200-hicache.example`), and the generated adapters doc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core import env, registry
from adapter.ops import docs
from adapter.switches import autotune_keep

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / ".env.tp4.example"
PROFILES = [PROFILE, ROOT / ".env.h200-hicache.example"]
each_profile = pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)


def _docker_env_file(profile: Path) -> list[tuple[str, str]]:
    """The profile as ``docker run --env-file`` reads it (moby's ``opts.ParseEnvFile``), written here
    apart from the overlay's parser: each line loses its leading blanks; an empty one or one that
    starts with ``#`` is skipped; the rest is split at its first ``=``, the key loses its leading
    blanks, the value is taken as it stands (no quote removal, no expansion, no trimming)."""
    pairs = []
    for line in profile.read_text().splitlines():
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and key and not any(c.isspace() for c in key), f"docker refuses or passes through: {line!r}"
        pairs.append((key, value))
    return pairs


def _registry_keys() -> list[str]:
    return [k.name for s in registry.SWITCHES for k in s.keys]


@each_profile
def test_docker_reads_every_key_and_the_launch_line_of_the_profile_as_the_overlay_does(profile):
    """``docker run --env-file`` (and compose's ``env_file``) gives the container every key of the
    profile, the launch arguments in LAUNCH_ARGS, with no quote kept in a value; ``check``,
    ``receipts`` and ``simulate`` read the same keys and values."""
    pairs = _docker_env_file(profile)
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), "each key once"
    docker = dict(pairs)
    assert docker == env.read_env_file(str(profile))
    launch = docker["LAUNCH_ARGS"].split()  # as the container's shell splits an unquoted $LAUNCH_ARGS
    assert launch[:2] == ["--model-path", "/models/DeepSeek-V4.1"] and "--tp-size" in launch
    assert not any(c in value for value in docker.values() for c in "\"'$")
    assert {"DSV41_AUTOTUNE_KEEP", "DSV41_DECODE_YIELD", "DSV41_SWA_THIN", "DSV41_SWA_CONE_REPLAY",
            "DSV41_SWA_CONE_TOKENS"} <= set(docker)


@each_profile
def test_the_switches_follow_the_launch_line_in_the_registry_order(profile):
    keys = [k for k, _ in _docker_env_file(profile)]
    switches = [k for k in keys if k.startswith("DSV41_")]
    assert keys == ["LAUNCH_ARGS", *switches]
    assert switches == [k for k in _registry_keys() if k in switches]
    if profile == PROFILE:
        assert switches[:6] == [
            "DSV41_AUTOTUNE_KEEP", "DSV41_SWA_NATIVE_DECODE", "DSV41_DECODE_YIELD",
            "DSV41_SWA_THIN", "DSV41_SWA_CONE_REPLAY", "DSV41_SWA_CONE_TOKENS",
        ]


def test_the_datacenter_profile_runs_hicache_beside_the_switches_and_leaves_out_what_refuses_beside_it():
    profile = env.read_env_file(str(PROFILES[1]))
    args = profile["LAUNCH_ARGS"].split()
    assert "--enable-hierarchical-cache" in args and "--hicache-size" not in args  # DeepSeek-V4 refuses a size
    assert args[args.index("--hicache-ratio") + 1] == "2"
    assert args[args.index("--hicache-write-policy") + 1] == "write_through"
    assert "DSV41_KV_PARK" not in profile  # off until tools/gpu/check.sh meets its targets on the image
    assert "DSV41_SWA_NATIVE_DECODE" not in profile  # SM120/SM121 only
    assert {"DSV41_SWA_THIN", "DSV41_SWA_CONE_REPLAY", "DSV41_DECODE_YIELD"} <= set(profile)
    assert "--enable-hierarchical-cache" not in env.read_env_file(str(PROFILE))["LAUNCH_ARGS"]  # GB10: shared memory


@each_profile
def test_the_launch_arguments_carry_tails_384_and_chunk_8192_exactly_once(profile):
    args = env.read_env_file(str(profile))["LAUNCH_ARGS"].split()
    assert args.count("--swa-prefix-tails") == 1 and args[args.index("--swa-prefix-tails") + 1] == "384"
    assert args.count("--chunked-prefill-size") == 1 and args[args.index("--chunked-prefill-size") + 1] == "8192"
    assert profile.read_text().count("--swa-prefix-tails 384") == 1


@each_profile
def test_every_profile_key_is_known_to_the_registry_and_valid(profile):
    config = registry.resolve(env.read_env_file(str(profile)))
    assert config.errors == [] and config.warnings == []
    assert {s.on_key.name for s in config.requested} >= {
        "DSV41_AUTOTUNE_KEEP", "DSV41_DECODE_YIELD", "DSV41_SWA_THIN", "DSV41_SWA_CONE_REPLAY",
    }


@each_profile
def test_test_only_keys_are_in_no_profile(profile):
    test_only = {k.name for k in registry.all_keys().values() if k.test_only} | {"DSV41_DEBUG_LOG"}
    assert not test_only & set(env.read_env_file(str(profile)))


def test_with_no_key_set_no_switch_is_requested_and_the_profile_requests_only_what_it_sets():
    assert registry.resolve({}).requested == []
    profile = env.read_env_file(str(PROFILE))
    for switch in registry.resolve(profile).requested:
        assert switch.on_key.name in profile or any(switch.name in r.requires for r in registry.SWITCHES
                                                  if r.on_key.name in profile)


@pytest.mark.parametrize("switch", registry.SWITCHES, ids=lambda s: s.name)
def test_each_switchs_effect_on_the_autotune_fingerprint_matches_its_registry_volatility(switch):
    profile = env.read_env_file(str(PROFILE))
    without = {k: v for k, v in profile.items() if k not in {key.name for key in switch.keys}}
    toggled = {**without, switch.on_key.name: "1" if switch.on_key.parser.allowed.startswith("1/0") else "33"}
    same = autotune_keep.launch_fingerprint(["serve"], without) == autotune_keep.launch_fingerprint(["serve"], toggled)
    assert same is switch.volatile


def test_the_adapters_doc_is_generated_from_the_registry_and_up_to_date():
    assert docs.DOC.read_text() == docs.render(), "run: python -m adapter docs"
    text = docs.DOC.read_text()
    for switch in registry.SWITCHES:
        assert f"`{switch.name}`" in text and all(f"`{t}`" in text for t in switch.pinned)


@pytest.mark.slow
@pytest.mark.spawns
@each_profile
def test_check_passes_on_each_shipped_profile_on_cpu(profile):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    out = subprocess.run([sys.executable, "-m", "adapter", "check", "--env-file", str(profile)], cwd=ROOT,
                         env={**environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
