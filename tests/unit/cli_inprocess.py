"""Running the command line's ``main`` inside the test process, undone afterwards: what a
daemon's process keeps for its lifetime (the start method and Ray's variables it exports,
``vllm --help=<keyword>``'s search keyword on vLLM's parser class, structlog's configuration)
must not leak into the tests that run after."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def cli_in_process() -> Iterator[None]:
    import structlog
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    environ, keyword = dict(os.environ), FlexibleArgumentParser._search_keyword
    logging = structlog.get_config()  # main() configures the daemon's log format (and stream: stderr as it is then)
    try:
        yield
    finally:
        structlog.configure(**logging)
        FlexibleArgumentParser._search_keyword = keyword
        os.environ.clear()
        os.environ.update(environ)
