"""Names of vLLM's engine arguments, read without importing vLLM.

Importing vLLM takes ~9 s and drags in torch; config validation must finish (and
fail) before that. So we parse ``vllm/engine/arg_utils.py`` with ``ast`` and
collect the annotated fields of the ``EngineArgs`` dataclass.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

# Set by the supervisor from its own typed settings; a passthrough may not override them.
_RESERVED = frozenset(
    {
        "model",
        "served_model_name",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_model_len",
        "dtype",
        "enforce_eager",
        "seed",
        "gpu_memory_utilization",
        "distributed_executor_backend",
        "worker_cls",
        "executor",
    }
)


def reserved_engine_args() -> frozenset[str]:
    return _RESERVED


@functools.cache
def vllm_engine_arg_names() -> frozenset[str]:
    """Field names of ``vllm.engine.arg_utils.EngineArgs``; empty when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names = {
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
            if node.name == "EngineArgs":
                return frozenset(names)
    return frozenset()
