"""Every upstream function a switch calls with a fixed signature is pinned in that switch's record.

The walk: each switch's source is parsed, and every name it calls (``x.name(...)`` or ``name(...)``)
that is a function or method of an SGLang class in the modules the switch touches must be one of
its record's pinned targets (``wraps`` or ``relies_on``), so that drift there refuses the switch
instead of breaking it at run time. Names that only collide with an upstream method (a tensor's
``view``, a set's ``clear``, the switch's own helpers) are listed below with the reason.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from adapter.core import registry

ROOT = Path(__file__).resolve().parents[2]

# Modules whose classes a switch's code reaches through the objects it is handed (allocators, pools,
# tree cores, requests, forward batches), beside the modules of its own pinned targets.
REACHED = (
    "sglang.srt.mem_cache.allocator.swa", "sglang.srt.mem_cache.allocator.base", "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    "sglang.srt.mem_cache.unified_cache.components.swa", "sglang.srt.mem_cache.unified_cache.components.full",
    "sglang.srt.mem_cache.unified_cache.components.base", "sglang.srt.managers.schedule_batch",
    "sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool", "sglang.srt.mem_cache.deepseek_v4_compress_state",
    "sglang.srt.model_executor.forward_batch_info", "sglang.srt.mem_cache.common",
)

# Called names that are not upstream calls, or whose upstream callee needs no pin, and why.
NOT_UPSTREAM: dict[str, str] = {
    "clear": "set / dict / list .clear() of the switch's own state",
    "set": "a threading.Event's .set()",
    "view": "torch.Tensor.view",
    "cat": "torch.cat",
    "clone": "torch.Tensor.clone",
    "copy": "dict.copy / the capture lock's copy() context manager, not ScheduleBatch.copy",
    "reset": "the switch's own counters (Counters.reset / module reset())",
    "_replace": "a NamedTuple's _replace on the switch's own tuples",
    "_rows": "kv_park.regions._rows, the switch's own helper",
    "free": "the pool allocator's free, pinned on SWATokenToKVPoolAllocator; other allocators name it alike",
    "alloc": "pinned on SWATokenToKVPoolAllocator; ReqToTokenPool.alloc is never called by a switch",
    "available_size": "pinned on SWATokenToKVPoolAllocator",
    "get_kvcache": "pinned on SWATokenToKVPoolAllocator; the base allocator's returns the same attribute",
    "insert": "pinned on UnifiedRadixCache; RadixCache.insert is never reached (kv_park refuses other trees)",
    "is_root": "pinned on UnifiedTreeCore; UnifiedRadixCache.is_root delegates to it",
    "add": "set.add of the switch's own sets (kv_park); the PD decode queues' add is never called by a switch",
    "extend": "list.extend of the switch's own lists (kv_park); the PD decode queues' extend is never called",
    "wait": "threading.Event.wait of kv_park's store; cone_replay pins the LayerLoadingEvent.wait it calls",
    "write": "a file's write (kv_park's host ledger); ReqToTokenPool.write / HiCacheController.write are never called",
}


def _switch_files(switch: registry.Switch) -> list[Path]:
    segment = switch.install.partition(":")[0].split(".")[2]
    package = ROOT / "adapter" / "switches" / segment
    return sorted(package.rglob("*.py")) if package.is_dir() else [package.with_suffix(".py")]


def _upstream_callables(switch: registry.Switch) -> dict[str, list[str]]:
    """name -> ``module:qualname`` of every function and method defined in the modules it reaches."""
    found: dict[str, list[str]] = {}
    for module_name in sorted({t.partition(":")[0] for t in switch.pinned} | set(switch.modules) | set(REACHED)):
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if inspect.isfunction(obj) and obj.__module__ == module_name:
                found.setdefault(name, []).append(f"{module_name}:{name}")
            elif inspect.isclass(obj) and obj.__module__ == module_name:
                for attr, member in vars(obj).items():
                    if inspect.isfunction(member) or isinstance(member, (property, staticmethod, classmethod)):
                        found.setdefault(attr, []).append(f"{module_name}:{name}.{attr}")
    return found


def _called_names(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Attribute):
                    names.add(node.func.attr)
                elif isinstance(node.func, ast.Name):
                    names.add(node.func.id)
    return names


@pytest.mark.parametrize("switch", registry.SWITCHES, ids=lambda s: s.name)
def test_every_upstream_function_a_switch_calls_is_pinned_in_its_record(switch):
    upstream = _upstream_callables(switch)
    pinned = set(switch.pinned)
    unpinned = {
        name: upstream[name][:3]
        for name in sorted(_called_names(_switch_files(switch)) & set(upstream))
        if not name.startswith("__") and name not in NOT_UPSTREAM and not pinned & set(upstream[name])
    }
    assert unpinned == {}, f"{switch.name} calls upstream functions without a pin (add them to relies_on): {unpinned}"


def test_the_walk_finds_an_unpinned_call_when_one_is_added(tmp_path, monkeypatch):
    """The walk is not vacuous: a switch source that calls an upstream method it does not pin fails."""
    thin = registry.by_name("swa_thin")
    probe = tmp_path / "probe.py"
    probe.write_text("def f(core, node):\n    return core._split_node(node, 1)\n")
    relied = tuple(t for t in thin.relies_on if not t.endswith("._split_node"))
    stripped = type(thin)(**{**thin.__dict__, "relies_on": relied})
    names = _called_names([probe]) & set(_upstream_callables(stripped))
    assert names == {"_split_node"}
    assert not set(stripped.pinned) & set(_upstream_callables(stripped)["_split_node"])
