"""Probe only (``thin.py``), never shipped: in a ``vllm-supervisor serve`` process, the stream
path is cut to vLLM's own: ``Streams.run`` returns the serving engine's ``generate`` itself (no
carry-over, no reader, no request bookkeeping, no continuation). Every other process that finds
this file on ``PYTHONPATH`` (the engine core, helpers) is left alone."""

import importlib.abc
import sys

TARGET = "supervisor.stream"


def _thin(module) -> None:
    def run(self, prompt, sampling_params, request_id, kwargs):
        gen = self.d.pick((), False, None, None)
        return gen.engine.generate(prompt, sampling_params, request_id, **kwargs)

    module.Streams.run = run
    print("front-thin probe: Streams.run is vLLM's generate itself", file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            _thin(module)

        loader.exec_module = patched
        return spec


if sys.argv and sys.argv[0].endswith("vllm-supervisor") and "serve" in sys.argv[1:2]:
    import importlib.util  # noqa: E402

    sys.meta_path.insert(0, _Finder())
