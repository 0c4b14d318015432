"""Where a replica's placement group asks Ray to put its bundles (``RayCluster.create_placement_group``):
replicas spread over nodes, except the compiled-graph executor's first bundle, which stays on the
daemon's node (vLLM's ``_verify_bundles`` refuses a group without a bundle on its engine core's
node). Ray's placement is faked here: only what is asked is checked (a real single-node group is
placed by the integration tiers; spreading over real nodes by ``tests/chaos/test_multinode.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import executor.cluster as cluster
from config import RaySettings
from executor.cluster import NODE_ID_LABEL_KEY, RayCluster

HERE, OTHER = "node-here", "node-other"


class FakeGroup:
    def __init__(self, bundles, selectors):
        self.bundles, self.selectors = bundles, selectors

    def wait(self, timeout_seconds):
        return True


@pytest.fixture
def asked(monkeypatch):
    groups = []

    def placement_group(bundles, strategy, name, bundle_label_selector=None):
        groups.append(FakeGroup(bundles, bundle_label_selector))
        return groups[-1]

    monkeypatch.setattr(cluster, "placement_group", placement_group)
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [
        {"NodeID": n, "Alive": True, "Resources": {"GPU": 8}} for n in (HERE, OTHER)])
    monkeypatch.setattr(cluster.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: HERE))
    monkeypatch.setattr(RayCluster, "placement_group_nodes", staticmethod(lambda pg: [HERE]))
    return groups


def test_replicas_spread_to_a_node_of_their_own(asked):
    RayCluster(RaySettings()).create_placement_group("r1-pg", 2, "GPU", others=[object()])
    assert asked[-1].selectors == [{NODE_ID_LABEL_KEY: f"!in({HERE})"}] * 2


def test_the_compiled_graph_executors_first_bundle_stays_on_the_engine_cores_node(asked):
    RayCluster(RaySettings()).create_placement_group("r1-pg", 2, "GPU", others=[object()], first_bundle_here=True)
    assert asked[-1].selectors == [{NODE_ID_LABEL_KEY: HERE}, {NODE_ID_LABEL_KEY: f"!in({HERE})"}]
    RayCluster(RaySettings()).create_placement_group("pg", 2, "GPU", first_bundle_here=True)  # the first replica
    assert asked[-1].selectors == [{NODE_ID_LABEL_KEY: HERE}, {}]
    RayCluster(RaySettings()).create_placement_group("pg", 2, "GPU")
    assert asked[-1].selectors is None


def test_a_node_this_host_cannot_reach_gets_no_bundle(asked):
    """A partition Ray has not caught yet (``unreachable_nodes``): the group uses what is left."""
    RayCluster(RaySettings()).create_placement_group("pg", 2, "GPU", unreachable={OTHER: "10.0.0.2"})
    assert asked[-1].selectors == [{NODE_ID_LABEL_KEY: f"!in({OTHER})"}] * 2
    # a replica's spread never trades a reachable shared node for an unreachable free one
    RayCluster(RaySettings()).create_placement_group("r1-pg", 2, "GPU", others=[object()], unreachable={OTHER: "10.0.0.2"})
    assert asked[-1].selectors == [{NODE_ID_LABEL_KEY: f"!in({OTHER})"}] * 2


def test_a_group_not_placed_names_the_unreachable_nodes(asked, monkeypatch):
    class NeverPlaced(FakeGroup):
        def wait(self, timeout_seconds):
            return False

    monkeypatch.setattr(cluster, "placement_group", lambda bundles, strategy, name, bundle_label_selector=None:
                        NeverPlaced(bundles, bundle_label_selector))
    monkeypatch.setattr(cluster, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"GPU": 16})
    monkeypatch.setattr(cluster.ray, "available_resources", lambda: {"GPU": 8})
    with pytest.raises(cluster.PlacementGroupTimeout, match=r"unreachable from this host: 10\.0\.0\.2"):
        RayCluster(RaySettings(placement_timeout_s=0.1)).create_placement_group("pg", 16, "GPU", unreachable={OTHER: "10.0.0.2"})


def test_unreachable_nodes_are_those_whose_raylet_does_not_accept_a_connection(monkeypatch):
    import socket

    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()

    real = socket.create_connection

    def connect(address, timeout=None):
        if address[0] == "10.9.9.9":  # a partition: the connection times out (no packet leaves in this test)
            raise socket.timeout("timed out")
        return real(address, timeout)

    monkeypatch.setattr(cluster.socket, "create_connection", connect)
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [
        {"NodeID": "up", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": listening.getsockname()[1]},
        {"NodeID": "refusing", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": closed_port},
        {"NodeID": "cut", "Alive": True, "NodeManagerAddress": "10.9.9.9", "NodeManagerPort": 1},
        {"NodeID": "dead", "Alive": False, "NodeManagerAddress": "10.9.9.9", "NodeManagerPort": 1},
    ])
    try:
        # cut off (no answer), or its raylet gone (the host refuses): neither gets a bundle
        assert RayCluster.unreachable_nodes(timeout_s=0.5) == {"refusing": "127.0.0.1", "cut": "10.9.9.9"}
    finally:
        listening.close()


class FakeAgent:
    """RayLink's agent: the calls it makes, answered from a table."""

    def __init__(self, unreachable, nodes_of_group, ready=True):
        self.unreachable, self.nodes_of_group, self.ready = unreachable, nodes_of_group, ready
        self.calls = []

    def call(self, method, *args):
        self.calls.append((method, args))
        return {"unreachable_nodes": lambda: self.unreachable,
                "placement_group_nodes": lambda pg: self.nodes_of_group,
                "placement_group_ready": lambda pg: self.ready,
                "remove_placement_group": lambda pg: None,
                "create_placement_group": lambda *a: "new-pg"}[method](*args)


@pytest.mark.parametrize("unreachable, recreated", [({}, False), ({"n2": "10.0.0.2"}, True), ({"n9": "10.0.0.9"}, False)])
def test_a_group_with_a_bundle_on_an_unreachable_node_is_made_again_elsewhere(monkeypatch, unreachable, recreated):
    import executor.engine
    from supervisor.raylink import RayLink

    monkeypatch.setattr(executor.engine, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(executor.engine, "uses_compiled_graph", lambda: False)
    link = RayLink(RaySettings(), "d1", lambda: (2, 1))
    link.cluster = FakeAgent(unreachable, ["n1", "n2"])
    link.placement_groups[0] = "old-pg"
    link.ensure_placement_group(0)
    methods = [m for m, _ in link.cluster.calls]
    assert ("remove_placement_group" in methods) == recreated
    assert link.placement_groups[0] == ("new-pg" if recreated else "old-pg")
    if recreated:
        create = next(a for m, a in link.cluster.calls if m == "create_placement_group")
        assert create[-1] == unreachable  # and the new group avoids it


def test_cut_off_names_the_replicas_nodes_this_host_cannot_reach():
    """What the teardown asks before it waits for a killed worker to unmap its rings: one on a
    host cut off will not exit before the link is back (``EngineBuilder.teardown``)."""
    from supervisor.raylink import RayLink

    link = RayLink(RaySettings(), "d1", lambda: (2, 1))
    link.cluster = FakeAgent({"n2": "10.0.0.2", "n9": "10.0.0.9"}, ["n1", "n2"])
    assert link.cut_off(0) == []  # no group yet
    link.placement_groups[0] = "pg"
    assert link.cut_off(0) == ["10.0.0.2"]
    link.cluster.unreachable = {}
    assert link.cut_off(0) == []

    class Gone:
        def call(self, method, *args):
            raise RuntimeError("agent gone")

    link.cluster = Gone()
    assert link.cut_off(0) == []


def test_when_no_raylet_accepts_the_check_is_not_trusted(monkeypatch):
    """Every node unreachable, this host's own among them: a firewall on the raylet port, not a
    partition. Placing as Ray says beats never placing."""
    monkeypatch.setattr(cluster, "answers", lambda *a, **k: False)
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [
        {"NodeID": n, "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": 1} for n in ("a", "b")])
    assert RayCluster.unreachable_nodes() == {}
