"""Prefix-aware routing between replicas (``supervisor.routing``): the logic, on fake
generations. The real daemon's routing under a multi-turn chat load is ``bench.prefix_routing``."""

from __future__ import annotations

from types import SimpleNamespace

from supervisor.replica import ReplicaView, pick
from supervisor.states import ReplicaState


def Replica(index, current):
    """A serving replica as the owner's snapshot shows it (what ``pick`` reads)."""
    return ReplicaView(index, ReplicaState.SERVING, current, True)
from supervisor.routing import BLOCK, MAX_BLOCKS, PrefixRouter, block_hashes


def gen(number, streams=0, failed=False, epoch=0):
    return SimpleNamespace(number=number, readers=dict.fromkeys(range(streams)), failed=failed, epoch=epoch)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 for i in range(n)]


def test_block_hashes_name_prefixes():
    system = tokens(1, 3 * BLOCK)
    a, b = block_hashes(system + tokens(2, BLOCK + 5)), block_hashes(system + tokens(3, BLOCK))
    assert len(a) == 4 and len(b) == 4  # full blocks only: the 5 tokens after the 4th are not hashed
    assert a[:3] == b[:3] and a[3] != b[3]  # the same system prompt, different user turns
    assert block_hashes(tokens(1, BLOCK - 1)) == []
    assert block_hashes([9] + system[1:])[0] != block_hashes(system)[0]
    assert len(block_hashes(tokens(4, (MAX_BLOCKS + 10) * BLOCK))) == MAX_BLOCKS


def test_a_conversation_stays_where_its_prefix_is():
    router = PrefixRouter()
    a, b = Replica(0, gen(1)), Replica(1, gen(2))
    turn = tokens(5, 4 * BLOCK)
    first = pick([a, b], router=router, token_ids=turn)
    assert first is a.current  # no match yet: least streams, then the lowest index
    other = b if first is a.current else a
    for _ in range(3):  # each turn extends the last one's prompt; the other replica is idler by up to SLACK
        first.readers[object()] = None
        turn = turn + tokens(len(turn), 2 * BLOCK)
        assert len(first.readers) - len(other.current.readers) <= router.slack
        assert pick([a, b], router=router, token_ids=turn) is first
    assert router.status() == {"policy": "prefix", "routed": 4, "to_prefix": 3, "blocks": len(block_hashes(turn))}


def test_a_loaded_replica_gives_way_and_the_prefix_follows():
    router = PrefixRouter(slack=2)
    a, b = Replica(0, gen(1)), Replica(1, gen(2))
    prompt = tokens(6, 8 * BLOCK)
    assert pick([a, b], router=router, token_ids=prompt) is a.current
    a.current.readers.update(dict.fromkeys(range(3)))  # 3 streams above b: past the bound
    assert pick([a, b], router=router, token_ids=prompt) is b.current
    a.current.readers.clear()
    assert pick([a, b], router=router, token_ids=prompt) is b.current  # b served it last


def test_new_prefixes_spread_by_load():
    router = PrefixRouter()
    a, b = Replica(0, gen(1)), Replica(1, gen(2))
    sent = []
    for seed in range(6):  # six conversations with system prompts of their own
        g = pick([a, b], router=router, token_ids=tokens(100 + seed, 4 * BLOCK))
        g.readers[object()] = None
        sent.append(g.number)
    assert sent.count(1) == sent.count(2) == 3


def test_a_rebuilt_or_excluded_generation_does_not_match():
    router = PrefixRouter()
    a, b = Replica(0, gen(1)), Replica(1, gen(2, streams=1))
    prompt = tokens(7, 4 * BLOCK)
    assert pick([a, b], router=router, token_ids=prompt) is a.current
    a = Replica(0, gen(3, streams=2))  # replica 0 rebuilt: an empty cache under a new number (a new snapshot)
    assert pick([a, b], router=router, token_ids=prompt) is b.current  # no match: least streams
    assert pick([a, b], not_gens=(b.current,), router=router, token_ids=prompt) is a.current  # a continuation
    assert pick([a], router=router, token_ids=prompt) is a.current  # one candidate: no choice
    assert pick([Replica(0, gen(4, failed=True))], router=router, token_ids=prompt) is None


def test_memory_is_bounded():
    router = PrefixRouter(capacity=10)
    a, b = Replica(0, gen(1)), Replica(1, gen(2))
    for seed in range(20):
        pick([a, b], router=router, token_ids=tokens(seed, 4 * BLOCK))
    assert router.status()["blocks"] == 10


def test_the_slack_is_the_operators_and_zero_only_breaks_ties():
    """``supervisor.routing_slack`` (``--routing-slack``, Ray Serve's ``imbalanced_threshold``): how
    far the prefix's replica may be loaded above the least loaded one and still get the request."""
    from supervisor.cli import parse_serve

    settings, _ = parse_serve(["--data-parallel-size", "2", "--routing-slack", "0"])
    assert settings.supervisor.routing_slack == 0 and parse_serve([])[0].supervisor.routing_slack == 4
    router = PrefixRouter(slack=settings.supervisor.routing_slack)
    a, b = Replica(0, gen(1)), Replica(1, gen(2))
    prompt = tokens(8, 4 * BLOCK)
    assert pick([a, b], router=router, token_ids=prompt) is a.current
    b.current.readers.update(dict.fromkeys(range(1)))
    a.current.readers.update(dict.fromkeys(range(1)))  # a tie: the prefix decides
    assert pick([a, b], router=router, token_ids=prompt) is a.current
    a.current.readers[object()] = None  # one stream above: the least loaded
    assert pick([a, b], router=router, token_ids=prompt) is b.current
