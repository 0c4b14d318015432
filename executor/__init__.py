"""Everything that touches Ray and vLLM internals lives here.

- ``executor.ray_v2``: ``SupervisedRayExecutor``, vLLM's Ray V2 executor plus CPU support
  and worker-death events (runs inside vLLM's engine-core process).
- ``executor.events``: the typed event the executor sends to the supervisor (no Ray/vLLM).
- ``executor.cluster``: the Ray connection, placement groups and actor clean-up.
- ``executor.engine``: building and tearing down the ``AsyncLLM``.
- ``executor.shm``: finding and removing ``/dev/shm`` segments an engine left behind.

Only ``events`` is imported eagerly; the rest import Ray or vLLM and are loaded on use.
"""
