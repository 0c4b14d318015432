"""The owner alone changes state: no module but the owner's dispatch (``supervisor/owner.py``)
moves the daemon's or a replica's state machine, or writes what a replica or a generation
holds. An AST check over every module, as ``test_layers`` checks the imports.

What counts:
* a call of ``<anything>.transition(...)`` (the daemon's and the replicas' machines; the warm
  standby's own machine moves by its private ``_to``, inside ``supervisor/standby.py``);
* a store to ``<x>.<field>`` for a field of ``Replica`` or ``Generation`` state (below), where
  ``<x>`` is not ``self`` (an object's own fields are its business, e.g. the standby's
  ``state``), or to ``self.<field>`` inside ``Replica``, ``Generation`` or the composition root;
* ``setattr(<x>, "<field>", ...)`` for one of those fields.

``python -m tests.unit.test_owner_alone`` prints what it finds.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_layers import LAYERS, ROOT

OWNER = "supervisor/owner.py"
# Replica: what it serves and builds, its recovery, budget wait and attempts; Generation: failed, planned;
# the daemon's and a replica's machine.
GUARDED = frozenset({"current", "building", "record", "served", "first", "attempt", "retry_at", "last_error",
                     "failed", "planned", "machine", "state"})
OWN_FIELDS_GUARDED = frozenset({"supervisor/replica.py", "supervisor/generation.py", "supervisor/daemon.py"})


def violations_in(source: str, path: str) -> list[str]:
    """What in ``source`` (the module at ``path``, relative to the root) changes state that only
    the owner may change."""
    if path == OWNER:
        return []
    found = []

    def store(target: ast.expr, line: int) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                store(t, line)
        elif isinstance(target, ast.Starred):
            store(target.value, line)
        elif isinstance(target, ast.Attribute) and target.attr in GUARDED:
            own = isinstance(target.value, ast.Name) and target.value.id == "self"
            if not own or path in OWN_FIELDS_GUARDED:
                found.append(f"{path}:{line}: assigns .{target.attr}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                store(target, node.lineno)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.target is not None:
            store(node.target, node.lineno)
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr == "transition":
                found.append(f"{path}:{node.lineno}: calls .transition()")
            elif (isinstance(fn, ast.Name) and fn.id == "setattr" and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in GUARDED):
                found.append(f"{path}:{node.lineno}: setattr(..., {node.args[1].value!r})")
    return found


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for pkg in LAYERS:
        for path in sorted((root / pkg).glob("*.py")):
            found += violations_in(path.read_text(), str(path.relative_to(root)))
    return found


def test_only_the_owner_changes_state():
    assert violations() == []


def test_the_owner_does_change_state():
    """The check looks where the changes are: the owner's own module has them."""
    owner = (ROOT / OWNER).read_text()
    assert violations_in(owner, "supervisor/elsewhere.py"), "the check finds nothing even in the owner"


def test_the_check_can_fail():
    bad = '''
def recover(sup, rep, gen):
    rep.current = None
    sup.replicas[0].building = 3
    gen.failed = True
    old, rep.retry_at = 1, 2
    sup.machine.transition("recovering", "x")
    setattr(rep, "served", True)

class Replica:
    def die(self):
        self.current = None
'''
    found = violations_in(bad, "supervisor/replica.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "assigns .current", "assigns .building", "assigns .failed", "assigns .retry_at", "calls .transition()",
        "setattr(..., 'served')", "assigns .current"], found
    # an object's own fields, outside Replica, Generation and the root: its own business
    assert violations_in("class Standby:\n    def _to(self, s):\n        self.state = s\n", "supervisor/standby.py") == []


if __name__ == "__main__":
    for v in violations():
        print(v)
