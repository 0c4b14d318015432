"""Prefix-aware routing between replicas: a new request goes where its prompt's prefix was served.

Each replica's engine keeps a prefix cache (vLLM's automatic prefix caching): a request whose
leading tokens a replica has just processed skips that part of the prefill there, and only
there. Least-streams routing spreads the turns of one chat, or the requests sharing one system
prompt, over every replica, and each pays the whole prefill again. The peers route by prefix
(Ray Serve LLM's ``PrefixCacheAffinityRouter``, llm-d's prefix-cache scorer, Dynamo's KV router).

``PrefixRouter`` remembers, for the leading ``BLOCK``-token blocks of the prompts it routed
(chained hashes, as vLLM hashes its cache blocks; at most ``MAX_BLOCKS`` per prompt), which
engine generation served them last, in an LRU of ``CAPACITY`` blocks. A request goes to the
generation holding its longest remembered prefix, unless that one runs more than ``slack``
streams above the least loaded candidate (then least streams, as with no match): the cache
is worth a few queued requests, not an idle replica left idle. A generation that failed or was
rebuilt has a new number, so what the old one held no longer matches. The engine's cache may
have evicted a block the router still names: that costs one prefill, as with least streams.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

BLOCK = 16  # tokens per remembered block
MAX_BLOCKS = 256  # leading blocks remembered per prompt (4096 tokens)
CAPACITY = 1 << 17  # blocks remembered in all (LRU), ≈ 20 MiB at most
SLACK = 4  # streams above the least loaded candidate that a prefix match is still worth


def block_hashes(token_ids: Sequence[int]) -> list[int]:
    """Chained hashes of the full leading ``BLOCK``-token blocks: block i's hash covers tokens
    0 … (i+1)·BLOCK - 1, so equal hashes mean equal prefixes."""
    out: list[int] = []
    h = 0
    for start in range(0, min(len(token_ids), MAX_BLOCKS * BLOCK) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(token_ids[start:start + BLOCK])))
        out.append(h)
    return out


class PrefixRouter:
    def __init__(self, slack: int = SLACK, capacity: int = CAPACITY):
        self.slack = slack
        self.capacity = capacity
        self._served_by: OrderedDict[int, int] = OrderedDict()  # block hash -> generation number
        self.matched = 0  # requests sent where their prefix was (status)
        self.routed = 0  # requests routed with a prompt

    def choose(self, candidates: Sequence[Any], token_ids: Sequence[int] | None, load: Any) -> Any:
        """One of ``candidates`` (generations, each with ``number``) for a prompt of
        ``token_ids``; ``load(gen)`` is its streams. Without a prompt: the least loaded."""
        least = min(candidates, key=load)
        if not token_ids:
            return least
        hashes = block_hashes(token_ids)
        by_number = {gen.number: gen for gen in candidates}
        chosen = least
        for h in reversed(hashes):  # the longest remembered prefix first
            gen = by_number.get(self._served_by.get(h, -1))
            if gen is not None:
                if load(gen) <= load(least) + self.slack:
                    chosen = gen
                    self.matched += 1
                break
        self.routed += 1
        self._remember(hashes, chosen.number)
        return chosen

    def _remember(self, hashes: list[int], number: int) -> None:
        served_by = self._served_by
        for h in hashes:
            served_by[h] = number
            served_by.move_to_end(h)
        while len(served_by) > self.capacity:
            served_by.popitem(last=False)

    def status(self) -> dict[str, Any]:
        return {"policy": "prefix", "routed": self.routed, "to_prefix": self.matched, "blocks": len(self._served_by)}
