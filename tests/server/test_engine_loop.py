"""The engine loop with a controllable fake model: the fixture model behind a gate that makes each
forward pass slow or blocks it, so batching, aborts, queue limits and stalls can be observed."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from engine import Engine, EngineConfig, RequestError
from engine.decoding import DecodeParams
from server.energy import NvmlMeter
from server.engine_loop import EngineLoop, QueueFull, Submission
from server.metrics import Metrics


class GatedModel:
    """Wraps a model's forward: sleeps `delay` per call and can be paused."""

    def __init__(self, model, delay: float = 0.0) -> None:
        self.forward = model.forward
        self.delay = delay
        self.open = threading.Event()
        self.open.set()
        self.calls = 0
        model.forward = self

    def __call__(self, *args, **kwargs):
        self.open.wait()
        time.sleep(self.delay)
        self.calls += 1
        return self.forward(*args, **kwargs)


@pytest.fixture
def engine(fixtures):
    return Engine(EngineConfig(model=str(fixtures / "llada_tiny"), max_batch=4))


def _params(**kw) -> DecodeParams:
    return DecodeParams(policy="cai", gen_length=16, block_length=8, **kw)


async def _collect(subs: list[Submission], timeout: float = 30.0) -> dict[int, object]:
    out: dict[int, object] = {}
    queue = subs[0].queue
    while len(out) < len(subs):
        event = await asyncio.wait_for(queue.get(), timeout)
        if event.kind in ("done", "error"):
            out[event.choice] = event
    return out


def _submissions(engine: Engine, n: int, params: DecodeParams, stream: bool = False) -> list[Submission]:
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    return [Submission(f"r{i}", engine.resolve((1 + i, 2, 3), params), i, queue, loop, stream) for i in range(n)]


def test_continuous_batching_respects_max_batch(engine):
    gate = GatedModel(engine.model, delay=0.002)
    seen: list[int] = []
    loop = EngineLoop(engine, max_queue=32, metrics=Metrics("m"), meter=NvmlMeter(lambda: 0))
    original = engine.step

    def step():
        outputs = original()
        seen.append(len(outputs))
        return outputs

    engine.step = step

    async def run():
        subs = _submissions(engine, 10, _params())
        for sub in subs:
            loop.submit([sub])
        return await _collect(subs)

    loop.start()
    try:
        events = asyncio.run(run())
    finally:
        loop.stop()
    assert all(e.kind == "done" for e in events.values())
    assert max(seen) == 4 and gate.calls > 0
    # later requests joined as rows freed up: batches of 4 happened before the last requests finished
    assert seen.count(4) > 1


def test_abort_frees_the_row_within_a_step(engine):
    GatedModel(engine.model, delay=0.01)
    loop = EngineLoop(engine, max_queue=8, metrics=Metrics("m"), meter=NvmlMeter(lambda: 0))

    async def run():
        [sub] = _submissions(engine, 1, DecodeParams(policy="fixed", gen_length=256, block_length=64, steps=256))
        loop.submit([sub])
        while engine.num_running == 0:
            await asyncio.sleep(0.005)
        steps_before = loop.steps
        loop.abort("r0")
        while engine.num_running:
            await asyncio.sleep(0.002)
        return loop.steps - steps_before

    loop.start()
    try:
        assert asyncio.run(run()) <= 2
    finally:
        loop.stop()


def test_waiting_queue_is_bounded(engine):
    gate = GatedModel(engine.model)
    gate.open.clear()  # nothing finishes while we fill the queue
    loop = EngineLoop(engine, max_queue=2, metrics=Metrics("m"), meter=NvmlMeter(lambda: 0))

    async def run():
        subs = _submissions(engine, 10, _params())
        accepted = 0
        loop.submit([subs[0]])
        accepted = 1
        deadline = time.monotonic() + 30  # the engine admits it into a row and its step blocks
        while engine.num_running == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        with pytest.raises(QueueFull):  # a request of 6 choices: 3 would fill the free rows, 3 wait
            loop.submit(subs[1:7])
        assert loop.num_waiting == 0  # refused as a whole
        with pytest.raises(QueueFull):
            for sub in subs[1:]:
                loop.submit([sub])
                accepted += 1
        return accepted

    loop.start()
    try:
        accepted = asyncio.run(run())
        # the first request was admitted and its step is blocked; admission happens between steps:
        # the next 3 take the free rows at the next step, and max_queue more wait behind them
        assert accepted == 1 + 3 + 2
        assert loop.num_waiting == 3 + 2
    finally:
        gate.open.set()
        loop.stop()


def test_stall_is_visible_while_work_is_pending(engine):
    gate = GatedModel(engine.model)
    gate.open.clear()
    loop = EngineLoop(engine, max_queue=4, metrics=Metrics("m"), meter=NvmlMeter(lambda: 0))

    async def run():
        [sub] = _submissions(engine, 1, _params())
        loop.submit([sub])
        deadline = time.monotonic() + 30  # bounded polling: the blocked step shows as time without progress
        while time.monotonic() - loop.last_progress <= 0.3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return loop.num_pending, time.monotonic() - loop.last_progress

    loop.start()
    try:
        pending, stalled = asyncio.run(run())
        assert pending == 1 and stalled > 0.3
    finally:
        gate.open.set()
        loop.stop()


def test_bad_request_becomes_an_error_event_and_the_loop_survives(engine):
    loop = EngineLoop(engine, max_queue=4, metrics=Metrics("m"), meter=NvmlMeter(lambda: 0))

    async def run():
        loop_, queue = asyncio.get_running_loop(), asyncio.Queue()
        with pytest.raises(RequestError) as refused:  # the engine resolves (and checks) before submission
            loop.resolve((99999,), {"gen_length": 16, "block_length": 8}, None)
        good = Submission("good", engine.resolve((1, 2), _params()), 1, queue, loop_, False)
        loop.submit([good])
        return refused.value, await _collect([good])

    loop.start()
    try:
        refused, events = asyncio.run(run())
    finally:
        loop.stop()
    assert "vocabulary" in str(refused) and refused.param == "prompt_ids"
    assert events[1].kind == "done"


def test_streams_receive_growing_prefixes_and_energy_is_attributed(engine):
    counter = iter(range(0, 10**9, 1000))  # 1 J per read
    loop = EngineLoop(engine, max_queue=4, metrics=Metrics("m"), meter=NvmlMeter(lambda: next(counter)))

    async def run():
        subs = _submissions(engine, 2, _params(), stream=True)
        for sub in subs:
            loop.submit([sub])
        progress: list[list[int]] = []
        done = {}
        while len(done) < 2:
            event = await asyncio.wait_for(subs[0].queue.get(), 30)
            if event.choice == 0 and event.ids:  # deltas: the stream so far is their concatenation
                progress.append([*(progress[-1] if progress else []), *event.ids])
            if event.kind == "done":
                done[event.choice] = event
        return progress, done

    loop.start()
    try:
        progress, done = asyncio.run(run())
    finally:
        loop.stop()
    assert all(a == b[:len(a)] for a, b in itertools.pairwise(progress))
    result = done[0].result
    assert progress[-1] == result.generated_ids[:len(progress[-1])]
    assert len(progress[-1]) == (len(result.generated_ids) if result.end_index is None else result.end_index + 1)
    assert all(e.joules is not None and e.joules > 0 for e in done.values())
    rendered = loop.metrics.render().decode()
    assert "caidllm:energy_joules_total" in rendered
