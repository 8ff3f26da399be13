"""The native decode module's manifest and loader: nothing is loaded before its sha256 is checked, and
every failure is a one-line refusal; the build recipe's extraction of the stock host body (CPU)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from adapter.core import boot
from adapter.switches.native_decode import loader as ndm
from devkit.engine_kit.dsv4 import native_decode_stand_ins as stand_ins
from devkit.testkit import native_decode as kit

ROOT = Path(__file__).resolve().parents[2]


def _build_recipe():
    spec = importlib.util.spec_from_file_location("build_native_decode", ROOT / "runtime" / "build_native_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


class Recorder:
    def __init__(self):
        self.paths: list[Path] = []

    def __call__(self, path: Path):
        self.paths.append(path)
        return stand_ins.StubModule()


@pytest.fixture
def module_dir(tmp_path):
    kit.write_module_dir(tmp_path / "mod")
    return tmp_path / "mod"


def test_a_verified_module_is_loaded_from_the_file_the_manifest_names(module_dir):
    loader = Recorder()
    loaded = ndm.load(module_dir, "sm_121a", loader=loader)
    assert loader.paths == [module_dir / "dsv4_native_p256_sm121a.so"]
    assert loaded.sha256 == ndm.sha256_file(module_dir / "dsv4_native_p256_sm121a.so")
    assert loaded.arch == "sm_121a"


def test_a_so_whose_sha256_differs_from_the_manifest_is_refused_before_loading(module_dir):
    (module_dir / "dsv4_native_p256_sm120a.so").write_bytes(b"swapped after the build")
    loader = Recorder()
    with pytest.raises(ndm.LoadRefused, match=r"sha256 mismatch for dsv4_native_p256_sm120a.so.*not loaded"):
        ndm.load(module_dir, "sm_120a", loader=loader)
    assert loader.paths == []


def test_a_missing_module_file_refuses_the_switch(module_dir):
    (module_dir / "dsv4_native_p256_sm120a.so").unlink()
    with pytest.raises(ndm.LoadRefused, match=r"module file .*dsv4_native_p256_sm120a\.so is missing"):
        ndm.load(module_dir, "sm_120a", loader=Recorder())


def test_a_missing_manifest_is_refused_with_the_build_command(tmp_path):
    with pytest.raises(ndm.LoadRefused, match=r"no manifest at .*runtime/build_native_decode\.sh"):
        ndm.load(tmp_path, "sm_120a", loader=Recorder())


def test_an_edited_manifest_is_refused_as_tampered_even_when_the_so_matches_the_edit(module_dir):
    """Someone swaps the .so and writes its sha256 into the manifest without the build's digest."""
    swapped = module_dir / "dsv4_native_p256_sm120a.so"
    swapped.write_bytes(b"another module")
    new_sha = ndm.sha256_file(swapped)
    kit.rewrite_manifest(module_dir, lambda m: m["artifacts"]["sm_120a"].update(sha256=new_sha), keep_digest=True)
    loader = Recorder()
    with pytest.raises(ndm.LoadRefused, match="modified after the build"):
        ndm.load(module_dir, "sm_120a", loader=loader)
    assert loader.paths == []


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 1}), json.dumps([1, 2])])
def test_an_unreadable_or_incomplete_manifest_is_refused(module_dir, text):
    (module_dir / ndm.MANIFEST_NAME).write_text(text)
    with pytest.raises(ndm.LoadRefused, match=r"unreadable|malformed"):
        ndm.load(module_dir, "sm_120a", loader=Recorder())


def test_a_module_built_from_other_flashinfer_sources_is_refused(module_dir):
    def edit(manifest):
        label = next(iter(manifest["inputs"]))
        manifest["inputs"][label] = "0" * 64

    kit.rewrite_manifest(module_dir, edit, keep_digest=False)
    with pytest.raises(ndm.LoadRefused, match=r"FlashInfer source \{flashinfer\}/data/csrc/.* changed"):
        ndm.load(module_dir, "sm_120a", loader=Recorder())


def test_a_module_built_against_another_flashinfer_version_is_refused(module_dir):
    kit.rewrite_manifest(module_dir, lambda m: m["flashinfer"].update(version="0.7.1"), keep_digest=False)
    with pytest.raises(ndm.LoadRefused, match=r"flashinfer-python 0\.7\.2 is installed but the module was built against 0\.7\.1"):
        ndm.load(module_dir, "sm_120a", loader=Recorder())


def test_an_arch_the_manifest_lacks_is_refused(tmp_path):
    kit.write_module_dir(tmp_path, arches=("sm_121a",))
    with pytest.raises(ndm.LoadRefused, match=r"no module for sm_120a \(built: sm_121a\)"):
        ndm.load(tmp_path, "sm_120a", loader=Recorder())


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (12, 2), (8, 9)])
def test_an_unknown_device_arch_is_refused(capability):
    with pytest.raises(ndm.LoadRefused, match=f"unknown arch sm_{capability[0]}{capability[1]}: .*sm_120a, sm_121a"):
        ndm.arch_for_capability(capability)
    assert ndm.arch_for_capability((12, 0)) == "sm_120a"
    assert ndm.arch_for_capability((12, 1)) == "sm_121a"


def test_a_module_reporting_another_page_size_is_refused_after_loading(module_dir):
    with pytest.raises(ndm.LoadRefused, match="serves page size 64, expected 256"):
        ndm.load(module_dir, "sm_120a", loader=lambda path: stand_ins.StubModule(page_size=64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_on_this_cpu_machine_the_switch_refuses_cleanly_and_the_entry_stays_stock():
    state = boot.install({"DSV41_SWA_NATIVE_DECODE": "1"})
    module = importlib.import_module("sglang.kernels.ops.attention.flash_mla_sm120")
    outcome = state.outcomes["swa_native_decode"]
    assert outcome.status == "n/a"
    assert outcome.reason == "not applicable here: no CUDA device"
    assert all(p.ok for p in outcome.pins)
    assert not hasattr(module._flash_mla_flashinfer, "__wrapped__")


def test_the_module_folder_key_takes_only_an_absolute_path():
    from adapter.core import registry

    config = registry.resolve({"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_NATIVE_DECODE_DIR": "build/native"})
    assert config.errors == [
        "DSV41_NATIVE_DECODE_DIR='build/native' is not valid: expected an absolute path (starting with /)"
    ]
    config = registry.resolve({"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_NATIVE_DECODE_DIR": "/opt/nd"})
    assert not config.errors and config["DSV41_NATIVE_DECODE_DIR"] == "/opt/nd"


def test_the_recipe_extracts_exactly_the_stock_decode_body_from_the_installed_flashinfer():
    recipe = _build_recipe()
    chain_csrc = ndm._flashinfer_dir() / "data" / "csrc" / "sparse_mla_sm120"
    body = recipe.extract_stock_body((chain_csrc / "attention_binding.cu").read_text())
    assert body.startswith("static void StockDecodeDsv4Body(TensorView q,")
    assert body.rstrip().endswith("}")
    assert "dispatch_decode(params, plan, stream)" in body
    assert "SparseMlaSm120DecodeDsv3_2" not in body and "ExecuteAttentionPlan" not in body


def test_the_recipe_skips_declarations_and_braces_in_strings_and_refuses_a_missing_body():
    recipe = _build_recipe()
    text = (
        "void SparseMlaSm120DecodeDsv4(int a);\n"
        'void SparseMlaSm120DecodeDsv4(int a) {\n  const char* s = "}{";  // } in a comment\n'
        "  if (a) { a = '}'; }\n}\nvoid Other() {}\n"
    )
    body = recipe.extract_stock_body(text)
    assert body.startswith("static void StockDecodeDsv4Body(int a) {") and body.endswith("'}'; }\n}")
    with pytest.raises(recipe.BuildError, match="expected one definition of SparseMlaSm120DecodeDsv4, found 0"):
        recipe.extract_stock_body("void Other() {}\n")
