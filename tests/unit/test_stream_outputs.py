"""The queue between an engine stream and its reader (``supervisor.stream.Outputs``): a reader
that falls behind reads the waiting DELTA outputs as one, in order, and nothing after an end or
an error is lost or reordered."""

from __future__ import annotations

import asyncio

from vllm.outputs import CompletionOutput, RequestOutput

from supervisor.generation import Interrupted
from supervisor.stream import Outputs


def out(ids: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(f"<{i}>" for i in ids)
    completion = CompletionOutput(index=0, text=text, token_ids=list(ids), cumulative_logprob=None, logprobs=None,
                                  finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], None, [completion], finished)


def drain(q: Outputs) -> list:
    async def run() -> list:
        items = []
        while not q.empty():
            items.append(await q.get())
        return items

    return asyncio.run(run())


def test_a_reader_behind_reads_the_waiting_deltas_as_one_output():
    q = Outputs(merge=True)
    for ids in ([1], [2, 3], [4]):
        q.put(out(ids))
    q.put(out([5], finished=True))
    [merged] = drain(q)
    c = merged.outputs[0]
    assert c.token_ids == [1, 2, 3, 4, 5] and c.text == "<1><2><3><4><5>"
    assert merged.finished and c.finish_reason == "length"


def test_a_reader_that_keeps_up_reads_each_output():
    async def run() -> list[list[int]]:
        q, seen = Outputs(merge=True), []
        for ids in ([1], [2], [3]):
            q.put(out(ids))
            seen.append(list((await q.get()).outputs[0].token_ids))
        return seen

    assert asyncio.run(run()) == [[1], [2], [3]]


def test_without_merge_every_output_is_its_own():
    q = Outputs(merge=False)
    for ids in ([1], [2], [3]):
        q.put(out(ids))
    assert [list(o.outputs[0].token_ids) for o in drain(q)] == [[1], [2], [3]]


def test_an_interruption_or_the_end_queues_behind_the_waiting_tokens():
    end = object()
    q = Outputs(merge=True)
    q.put(out([1]))
    q.put(out([2]))
    q.put(Interrupted())
    q.put(out([3]))  # a late output after the interruption is not merged into what came before it
    q.put(end)
    items = drain(q)
    assert list(items[0].outputs[0].token_ids) == [1, 2]
    assert isinstance(items[1], Interrupted)
    assert list(items[2].outputs[0].token_ids) == [3] and items[3] is end


def test_a_reader_waiting_on_an_empty_queue_is_woken_by_a_put():
    async def run():
        q = Outputs(merge=True)
        reader = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.01)
        assert not reader.done()
        q.put(out([7]))
        return await asyncio.wait_for(reader, 1)

    assert list(asyncio.run(run()).outputs[0].token_ids) == [7]
