"""An engine stream read in its reader's own task (``supervisor.stream.Streams.read``) and
interrupted by a recovery (``Generation.interrupt_streams``, ``supervisor.stream.Reader``):
a reader waiting on a hung engine raises ``Interrupted`` and its task goes on; one between
outputs stops before it reads again; a client's own cancel stays a cancel; a reader stuck in
a dead engine's abort is freed by the reap."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from supervisor.generation import Generation, Interrupted
from supervisor.stream import Streams


class Engine:
    """vLLM's ``AsyncLLM.generate`` in the parts that matter here: ``outputs`` tokens, then
    it hangs (``hang``); a cancel or a close aborts the request, which ``abort_hangs`` never
    returns from (a dead engine). With ``collectors``, its output processor wakes a waiting
    stream with an error, which ends it without the abort (vLLM's ``EngineDeadError``)."""

    def __init__(self, outputs: int = 3, hang: bool = True, abort_hangs: bool = False, collectors: bool = False):
        self.outputs, self.hang, self.abort_hangs = outputs, hang, abort_hangs
        self.aborted: list[str] = []
        self.woken = asyncio.Event()
        self.error: BaseException | None = None
        if collectors:
            self.output_processor = SimpleNamespace(propagate_error=self._propagate)

    def _propagate(self, exc):
        self.error = exc
        self.woken.set()

    async def generate(self, prompt, params, request_id):
        try:
            for i in range(self.outputs):
                await asyncio.sleep(0)
                yield i
            if self.hang:
                await self.woken.wait()
                raise self.error
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            if self.abort_hangs:
                await asyncio.Event().wait()
            raise


def generation(engine: Engine) -> Generation:
    return Generation(number=1, instance_id="i", engine=engine, shm_before=set(), build_s=0.0)


def streams() -> Streams:
    return Streams(SimpleNamespace(), SimpleNamespace(), lambda *a: None, lambda: None)


async def read(s: Streams, gen: Generation, got: list, rid: str = "r") -> str:
    try:
        async for out in s.read(gen, {}, None, rid):
            got.append(out)
    except Interrupted:
        await asyncio.sleep(0)  # the task goes on: no cancel left pending for it
        return "interrupted"
    return "ended"


async def waiting_on(engine: Engine) -> tuple[Generation, Streams, asyncio.Task, list]:
    """A client's task reading ``engine`` until its reader waits on the hung engine."""
    gen, s, got = generation(engine), streams(), []
    task = asyncio.create_task(read(s, gen, got))
    while len(got) < engine.outputs or not next(iter(gen.readers)).waiting:
        await asyncio.sleep(0.01)
    return gen, s, task, got


def test_a_reader_waiting_on_a_hung_engine_is_interrupted_and_its_task_goes_on():
    async def run():
        engine = Engine()
        gen, s, task, got = await waiting_on(engine)
        gen.interrupt_streams()
        assert await task == "interrupted" and got == [0, 1, 2]
        assert task.cancelling() == 0 and not gen.readers and not gen.lingering and not s._live
        assert engine.aborted == ["r"]  # vLLM's own abort ran, in the reader

    asyncio.run(run())


def test_a_reader_between_outputs_stops_before_it_reads_again_and_the_stream_is_closed():
    async def run():
        engine, gen, s = Engine(outputs=5, hang=False), None, streams()
        gen = generation(engine)
        got, agen = [], s.read(gen, {}, None, "r")
        got.append(await agen.__anext__())
        gen.interrupt_streams()  # the reader is between outputs (the client's write)
        with pytest.raises(Interrupted):
            await agen.__anext__()
        assert got == [0] and not gen.readers
        await gen.reap_lingering()
        assert engine.aborted == ["r"] and not gen.lingering  # closed off the reader

    asyncio.run(run())


def test_a_clients_own_cancel_stays_a_cancel_during_an_interruption():
    async def run():
        engine = Engine(abort_hangs=False)
        gen, s, task, got = await waiting_on(engine)
        gen.interrupt_streams()
        task.cancel()  # the client went away at the same moment
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not gen.readers and not gen.lingering

    asyncio.run(run())


def test_a_reader_stuck_in_a_dead_engines_abort_lingers_until_the_reap():
    async def run():
        engine = Engine(abort_hangs=True)
        gen, s, task, got = await waiting_on(engine)
        gen.interrupt_streams()
        await asyncio.sleep(0.05)
        assert not task.done() and len(gen.lingering) == 1  # inside the abort that never returns
        await gen.reap_lingering()
        assert await task == "interrupted" and task.cancelling() == 0 and not gen.lingering

    asyncio.run(run())


def test_the_end_and_an_engine_error_reach_the_reader():
    async def run():
        s = streams()
        gen = generation(Engine(outputs=2, hang=False))
        got = []
        assert await read(s, gen, got) == "ended" and got == [0, 1] and not gen.readers

        class Failing(Engine):
            async def generate(self, prompt, params, request_id):
                yield 0
                raise RuntimeError("engine dead")

        gen = generation(Failing())
        with pytest.raises(RuntimeError, match="engine dead"):
            async for _ in s.read(gen, {}, None, "r"):
                pass
        assert not gen.readers and not gen.lingering

    asyncio.run(run())


def test_a_reader_woken_by_the_engine_is_out_at_once_without_vllms_abort():
    """vLLM wakes each stream waiting on a failed generation with its engine-dead error
    (``executor.engine.wake_streams_dead``): no abort of the request, which a dead engine
    may never answer, so nothing lingers and no reap is needed."""
    from vllm.v1.engine.exceptions import EngineDeadError

    async def run():
        engine = Engine(abort_hangs=True, collectors=True)
        gen, s, task, got = await waiting_on(engine)
        gen.interrupt_streams()
        assert await asyncio.wait_for(task, 1) == "interrupted"
        assert isinstance(engine.error, EngineDeadError) and engine.aborted == [] and not gen.lingering

    asyncio.run(run())


def test_a_finished_request_ends_as_in_vllm_serve_not_by_vllms_abort():
    """The reader stops at the finished output (``Streams._choice`` breaks there): vLLM's
    generator has already returned after it, so nothing aborts a request that finished."""

    class Finishing(Engine):
        async def generate(self, prompt, params, request_id):
            try:
                for i in range(3):
                    await asyncio.sleep(0)
                    yield SimpleNamespace(n=i, finished=i == 2)
            except (asyncio.CancelledError, GeneratorExit):
                self.aborted.append(request_id)
                raise

    async def run():
        engine, s = Finishing(), streams()
        gen, got = generation(engine), []
        agen = s.read(gen, {}, None, "r")
        async for out in agen:
            got.append(out.n)
            if out.finished:
                break
        await agen.aclose()
        await asyncio.sleep(0.01)
        assert got == [0, 1, 2] and engine.aborted == [] and not gen.lingering and not gen.readers

    asyncio.run(run())
