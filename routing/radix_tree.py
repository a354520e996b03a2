"""A multi-tenant approximate radix tree over prompt text, for the ``cache_aware`` baseline.

This reproduces the data structure of the SGLang router (sgl-project/sglang,
``sgl-router/src/tree.rs``, now ``sgl-model-gateway/src/policies/tree.rs``; introduced
in PR #2114, "cache-aware load-balancing router v1"): one tree per model whose edges
are labelled with raw text (characters, not tokens, to avoid tokenizing), where each
node records, per tenant (backend), the last time the tenant was routed a prompt
through it. Every backend's approximate cache is the union of the nodes it is
attached to, and its size is the sum of their characters (``tenant_chars``).

Semantics kept from the source:

- ``insert`` attaches the tenant to every node on the prompt's path (splitting an
  edge where the prompt diverges, the new upper half inheriting the tenants of the
  edge) and stamps them with the same time.
- ``match`` walks as far as the text matches (a partial edge counts its matched
  characters) and returns the matched length and the *first* tenant of the deepest
  node reached. Upstream "first" is the first key of a ``DashMap``, an arbitrary but
  fixed order; here it is the first tenant attached to that node (insertion order).
- ``touch`` restamps a tenant from a node up to the root (upstream ``prefix_match``
  does this for the tenant it returns).
- ``evict(max_chars)`` (upstream ``evict_tenant_by_size``): for every tenant above
  ``max_chars`` characters, detach it from its least recently used *leaf* nodes until
  it is at or below the limit; nodes left with no tenant and no child are deleted.

Differences, none of which changes a routing decision: time is a logical counter
(one tick per ``insert`` or ``touch``) instead of wall-clock milliseconds, and
eviction keeps, per tenant, the set of its nodes and sorts it by (last access,
deeper first) instead of scanning the whole tree into one heap. Because a node's
stamp for a tenant is never older than its descendants' (each stamp covers a whole
root path), that order visits a tenant's leaves before their ancestors, as the heap
of upstream leaves does.

Cost: ``match`` and ``insert`` are O(prompt length) with C-speed comparisons
(``str.startswith`` per edge, a galloping search only on the edge where the prompt
diverges) plus O(depth x tenants) Python work; eviction is O(k log k) in the number
of nodes ``k`` of the tenants over the limit.
"""

from __future__ import annotations

from collections.abc import Container, Iterable


class _Node:
    __slots__ = ("text", "children", "parent", "tenants", "end")

    def __init__(self, text: str, parent: _Node | None, end: int) -> None:
        self.text = text  # edge label (characters)
        self.children: dict[str, _Node] = {}  # first character of the child's label -> child
        self.parent = parent
        self.tenants: dict[str, int] = {}  # tenant -> last access tick, in attach order
        self.end = end  # characters from the root to the end of this node's label


def _common_prefix_len(text: str, i: int, label: str) -> int:
    """Length of the common prefix of ``text[i:]`` and ``label`` (characters)."""
    limit = min(len(label), len(text) - i)
    lo, step = 0, 64
    # Gallop: grow the matched span geometrically while it keeps matching.
    while lo < limit:
        hi = min(lo + step, limit)
        if text.startswith(label[lo:hi], i + lo):
            lo = hi
            step *= 2
        else:
            break
    else:
        return lo
    # The mismatch lies in [lo, hi): binary search for the longest matching span.
    hi = min(lo + step, limit) - 1  # label[lo:hi+1] does not match entirely
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[lo:mid], i + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class ApproxRadixTree:
    """One model's approximate prefix tree, shared by all its backends (tenants).

    ``tenant_chars[t]`` is the number of characters tenant ``t`` is attached to.
    """

    def __init__(self) -> None:
        self.root = _Node("", None, 0)
        self.tenant_chars: dict[str, int] = {}
        self._tenant_nodes: dict[str, set[_Node]] = {}
        self._tick = 0

    # -- queries -----------------------------------------------------------------

    def match(self, text: str, allowed: Container[str] | None = None) -> tuple[int, str | None, _Node]:
        """Longest prefix of ``text`` present in the tree.

        Returns ``(matched_chars, tenant, node)``: the matched length in characters, the
        first tenant of the deepest node reached (``None`` when the tree is empty) and
        that node (to pass to :meth:`touch`). With ``allowed``, only nodes holding at
        least one allowed tenant are followed and only an allowed tenant is returned.
        """
        node = self.root
        i = 0
        n = len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            if allowed is not None and not any(t in allowed for t in child.tenants):
                break
            label = child.text
            if text.startswith(label, i):
                i += len(label)
                node = child
                continue
            i += _common_prefix_len(text, i, label)
            node = child
            break
        tenant = None
        for t in node.tenants:
            if allowed is None or t in allowed:
                tenant = t
                break
        return i, tenant, node

    def smallest_tenant(self, tenants: Iterable[str]) -> str:
        """The tenant among ``tenants`` attached to the fewest characters (unknown
        tenants count 0); the first one on ties. ``tenants`` must be non-empty."""
        chars = self.tenant_chars
        best, best_chars = None, None
        for t in tenants:
            c = chars.get(t, 0)
            if best_chars is None or c < best_chars:
                best, best_chars = t, c
        assert best is not None
        return best

    # -- updates -----------------------------------------------------------------

    def _attach(self, node: _Node, tenant: str, tick: int) -> None:
        if tenant not in node.tenants:
            self.tenant_chars[tenant] += len(node.text)
            self._tenant_nodes[tenant].add(node)
        node.tenants[tenant] = tick

    def insert(self, text: str, tenant: str) -> None:
        """Record that ``tenant`` was sent ``text``: attach it along the whole path."""
        self._tick += 1
        tick = self._tick
        if tenant not in self.tenant_chars:
            self.tenant_chars[tenant] = 0
            self._tenant_nodes[tenant] = set()
        node = self.root
        node.tenants[tenant] = tick
        i = 0
        n = len(text)
        while i < n:
            c = text[i]
            child = node.children.get(c)
            if child is None:
                leaf = _Node(text[i:], node, n)
                node.children[c] = leaf
                self._attach(leaf, tenant, tick)
                return
            label = child.text
            if text.startswith(label, i):
                self._attach(child, tenant, tick)
                i += len(label)
                node = child
                continue
            k = _common_prefix_len(text, i, label)  # 1 <= k < len(label)
            upper = _Node(label[:k], node, child.end - len(label) + k)
            upper.tenants = dict(child.tenants)
            for t in upper.tenants:
                self._tenant_nodes[t].add(upper)
            child.text = label[k:]
            child.parent = upper
            upper.children[child.text[0]] = child
            node.children[c] = upper
            self._attach(upper, tenant, tick)
            i += k
            node = upper

    def touch(self, node: _Node | None, tenant: str) -> None:
        """Restamp ``tenant`` on ``node`` and its ancestors that hold it."""
        self._tick += 1
        tick = self._tick
        while node is not None:
            if tenant in node.tenants:
                node.tenants[tenant] = tick
            node = node.parent

    def evict(self, max_chars: int) -> int:
        """Bring every tenant to at most ``max_chars`` characters by detaching it from
        its least recently used leaves. Returns the number of characters detached."""
        freed = 0
        for tenant, chars in self.tenant_chars.items():
            if chars <= max_chars:
                continue
            nodes = self._tenant_nodes[tenant]
            order = sorted(nodes, key=lambda nd: (nd.tenants[tenant], -nd.end))
            for nd in order:
                if chars <= max_chars:
                    break
                del nd.tenants[tenant]
                nodes.discard(nd)
                chars -= len(nd.text)
                freed += len(nd.text)
                if not nd.tenants and not nd.children and nd.parent is not None:
                    del nd.parent.children[nd.text[0]]
                    nd.parent = None
            self.tenant_chars[tenant] = chars
        return freed

    def node_count(self) -> int:
        """Number of nodes, the root included (O(nodes); for tests and stats)."""
        count, stack = 0, [self.root]
        while stack:
            nd = stack.pop()
            count += 1
            stack.extend(nd.children.values())
        return count
