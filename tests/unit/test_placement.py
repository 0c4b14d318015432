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
