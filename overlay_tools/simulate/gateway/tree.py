"""smg's approximate tree (``crates/kv_index/src/string_tree.rs`` of smg 1.13.0) at page granularity.

One tree for the model, shared by every worker (tenant): a node per page of a request's text
equivalent, named by its hash-chain key (equal keys, equal prefixes), holding each tenant that had
the page inserted with the time of that insert. Invariants (checked by the tests): a tenant on a
node is on its parent; ``size`` is the sum over nodes of their tenant counts (smg's
``total_char_size``, here in pages); a node without tenants is removed.

* :meth:`match`: the longest prefix present (whoever holds it) and the tenants of its deepest node
  (``matched_tenants``, ``string_tree.rs:282``).
* :meth:`insert`: the path for one tenant, stamping it.
* :meth:`evict_to`: ``evict_tenant_by_size`` (``string_tree.rs:1132``): while the tree is over
  the budget, the oldest (tenant, leaf) pair across all tenants goes; a parent left a leaf for
  that tenant joins the queue.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class _Node:
    parent: int | None
    tenants: dict[int, int] = field(default_factory=dict)  # tenant -> last insert time
    child_tenants: dict[int, int] = field(default_factory=dict)  # tenant -> children holding it
    children: int = 0


class ApproxTree:
    def __init__(self) -> None:
        self.nodes: dict[int, _Node] = {}
        self.size = 0  # (node, tenant) pairs: pages held, counted once per tenant
        self.clock = 0
        self.evicted = 0

    def match(self, keys: tuple[int, ...] | list[int]) -> tuple[int, set[int]]:
        depth = 0
        for key in keys:
            if key not in self.nodes:
                break
            depth += 1
        return depth, (set(self.nodes[keys[depth - 1]].tenants) if depth else set())

    def depth_for(self, keys: tuple[int, ...] | list[int], tenant: int) -> int:
        depth = 0
        for key in keys:
            node = self.nodes.get(key)
            if node is None or tenant not in node.tenants:
                break
            depth += 1
        return depth

    def insert(self, keys: tuple[int, ...] | list[int], tenant: int) -> None:
        self.clock += 1
        parent: int | None = None
        for key in keys:
            node = self.nodes.get(key)
            if node is None:
                node = self.nodes[key] = _Node(parent)
                if parent is not None:
                    self.nodes[parent].children += 1
            if tenant not in node.tenants:
                self.size += 1
                if parent is not None:
                    up = self.nodes[parent].child_tenants
                    up[tenant] = up.get(tenant, 0) + 1
            node.tenants[tenant] = self.clock
            parent = key

    def _is_leaf(self, node: _Node, tenant: int) -> bool:
        return tenant in node.tenants and not node.child_tenants.get(tenant)

    def evict_to(self, max_pages: int) -> None:
        if self.size <= max_pages:
            return
        queue = [(node.tenants[t], t, key) for key, node in self.nodes.items() for t in node.tenants
                 if self._is_leaf(node, t)]
        heapq.heapify(queue)
        while self.size > max_pages and queue:
            _, tenant, key = heapq.heappop(queue)
            node = self.nodes.get(key)
            if node is None or not self._is_leaf(node, tenant):
                continue
            del node.tenants[tenant]
            self.size -= 1
            self.evicted += 1
            parent = self.nodes.get(node.parent) if node.parent is not None else None
            if parent is not None:
                parent.child_tenants[tenant] -= 1
                if not parent.child_tenants[tenant]:
                    del parent.child_tenants[tenant]
            if not node.tenants and not node.children:
                del self.nodes[key]
                if parent is not None:
                    parent.children -= 1
            if parent is not None and self._is_leaf(parent, tenant):
                heapq.heappush(queue, (parent.tenants[tenant], tenant, node.parent))
