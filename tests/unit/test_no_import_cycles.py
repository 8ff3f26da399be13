"""No two modules of the overlay, its operator tools or its devkit import each other, directly or through others,
type-only imports (``if TYPE_CHECKING:``) included: a circle means one of them has two jobs."""

from __future__ import annotations

import grimp


def test_no_module_of_adapter_overlay_tools_or_devkit_is_part_of_an_import_circle():
    graph = grimp.build_graph("adapter", "overlay_tools", "devkit", include_external_packages=False)
    circles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported != module and graph.chain_exists(importer=imported, imported=module):
                chain = graph.find_shortest_chain(importer=imported, imported=module)
                circles.append(f"{module} -> {' -> '.join(chain)}")
    assert circles == []
