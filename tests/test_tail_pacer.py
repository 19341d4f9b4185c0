"""The thread that queues a held tail's stores on a GPU (engine/tail_pacer.py), on
test_scheduler's stand-in streams: every byte stored once, in order, after the main graph's
records; at most PACE_DEPTH slices queued ahead of the one it waits for; stopped where it is
by whatever needs the tail (the rest queued by the caller); its error raised there, after
the rest is queued."""

import threading
import time

import pytest
import torch
from test_scheduler import _Cuda, _Event

from muon_offload.engine import prefetch, tail_pacer
from muon_offload.engine.scheduler import StreamScheduler

SIZES = (5, 3000, 17, 1, 640, 2222)
SLICE = 700


def _tail(cuda, seed=0):
    gen = torch.Generator().manual_seed(seed)
    staged = [torch.randint(1, 256, (n,), dtype=torch.uint8, generator=gen) for n in SIZES]
    host = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    waits = []
    if cuda is not None:
        waits.append(_Event())
        waits[0].record(cuda.compute)  # the main graph's record the first slice waits for
    return prefetch.HeldTail(list(zip(host, staged, strict=True)), waits), host, staged


def _stored(host) -> int:
    return int(sum((h != 0).sum() for h in host))


def _until(predicate, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the pacer never got there"
        time.sleep(0.001)


def _events(monkeypatch, host, on_sync=None):
    """Events that note the bytes stored when they are waited for (``on_sync`` runs then)."""
    synced = []

    class Event(_Event):
        def synchronize(self):
            synced.append(_stored(host))
            if on_sync is not None:
                on_sync()

    monkeypatch.setattr(torch.cuda, "Event", Event)
    return synced


@pytest.fixture
def paced(monkeypatch):
    cuda = _Cuda(monkeypatch)
    sched = cuda.scheduler(ring=2)
    monkeypatch.setattr(tail_pacer, "PACE_SLICE_BYTES", SLICE)
    return cuda, sched


def test_every_store_once_in_order_a_depth_of_slices_ahead(monkeypatch, paced):
    """From the first hook (``pace_tail`` starts the thread) to the first hook after the
    thread queued the last slice: each wait finds PACE_DEPTH slices queued past the bytes the
    last wait saw; the first store follows the main graph's record; ``stored`` ends the d2h
    stream; then the hook reports none left and the next loads may go."""
    cuda, sched = paced
    tail, host, staged = _tail(cuda)
    synced = _events(monkeypatch, host)
    prefetch.hold_tail(sched, tail)
    assert not prefetch.pace_tail(sched)  # the thread started
    _until(lambda: sched.ahead.pacer.done)
    assert prefetch.pace_tail(sched)
    assert sched.ahead.tail is None and sched.ahead.pacer is None
    total = sum(SIZES)
    depth = tail_pacer.PACE_DEPTH
    assert synced == [(k + depth) * SLICE for k in range(len(synced))]
    assert len(synced) == -(-total // SLICE) - depth
    for h, s in zip(host, staged, strict=True):
        assert torch.equal(h, s)
    d2h = sched.d2h_stream
    assert d2h.waits[0].event is tail.waits[0] and sched.ahead.stored.node is d2h.last


def test_whatever_needs_the_tail_stops_the_thread_and_queues_the_rest(monkeypatch, paced):
    """``launch_tail`` (the next loads, a capture, a host reader) while the thread waits for
    a slice: the thread ends where it is, the caller queues the rest, every byte once."""
    cuda, sched = paced
    tail, host, staged = _tail(cuda, seed=1)
    waiting, go = threading.Event(), threading.Event()

    def hold():
        waiting.set()
        assert go.wait(20)

    synced = _events(monkeypatch, host, on_sync=hold)
    prefetch.hold_tail(sched, tail)
    assert not prefetch.pace_tail(sched)
    assert waiting.wait(20)
    thread = sched.ahead.pacer._thread
    threading.Timer(0.05, go.set).start()  # the slice it waits for runs meanwhile
    assert prefetch.launch_tail(sched)
    assert not thread.is_alive() and sched.ahead.pacer is None and sched.ahead.tail is None
    assert synced == [tail_pacer.PACE_DEPTH * SLICE]
    for h, s in zip(host, staged, strict=True):
        assert torch.equal(h, s)


def test_an_error_in_the_thread_is_raised_after_the_rest_is_queued(monkeypatch, paced):
    cuda, sched = paced
    tail, host, staged = _tail(cuda, seed=2)

    def fail():
        raise RuntimeError("an unspecified launch failure")

    _events(monkeypatch, host, on_sync=fail)
    prefetch.hold_tail(sched, tail)
    assert not prefetch.pace_tail(sched)
    thread = sched.ahead.pacer._thread
    _until(lambda: not thread.is_alive())
    assert not prefetch.pace_tail(sched)  # never done: the hooks wait, nothing prefetched
    with pytest.raises(RuntimeError, match="launch failure"):
        prefetch.launch_tail(sched)
    for h, s in zip(host, staged, strict=True):
        assert torch.equal(h, s)
    assert sched.ahead.tail is None and sched.ahead.pacer is None


def test_without_cuda_the_thread_copies_every_slice_itself(monkeypatch):
    """The CPU path: no events; the thread copies slice after slice while backward computes,
    and the hook after it ends reports none left."""
    monkeypatch.setattr(tail_pacer, "PACE_SLICE_BYTES", SLICE)
    sched = StreamScheduler(torch.device("cpu"))
    tail, host, staged = _tail(None, seed=3)
    prefetch.hold_tail(sched, tail)
    assert not prefetch.pace_tail(sched)
    _until(lambda: sched.ahead.pacer.done)
    assert prefetch.pace_tail(sched) and sched.ahead.tail is None
    for h, s in zip(host, staged, strict=True):
        assert torch.equal(h, s)


@pytest.mark.parametrize("cuda_path", [True, False])
def test_a_tail_of_at_most_a_depth_of_slices_is_queued_by_the_hook(monkeypatch, cuda_path):
    """The thread would queue PACE_DEPTH slices before its first wait: a tail no larger goes
    from the first hook itself, which reports none left, so that hook's prefetch follows at
    once (a thread that had not run yet held a small model's head to the step: its few
    hooks came before it)."""
    cuda = _Cuda(monkeypatch) if cuda_path else None
    sched = cuda.scheduler(ring=2) if cuda_path else StreamScheduler(torch.device("cpu"))
    tail, host, staged = _tail(cuda, seed=4)
    monkeypatch.setattr(tail_pacer, "PACE_SLICE_BYTES", -(-sum(SIZES) // tail_pacer.PACE_DEPTH))
    prefetch.hold_tail(sched, tail)
    assert prefetch.pace_tail(sched)
    assert sched.ahead.tail is None and sched.ahead.pacer is None
    for h, s in zip(host, staged, strict=True):
        assert torch.equal(h, s)
    if cuda_path:
        d2h = sched.d2h_stream
        assert d2h.waits[0].event is tail.waits[0] and sched.ahead.stored.node is d2h.last
    tail, host, _ = _tail(cuda, seed=5)  # a byte more: the thread
    monkeypatch.setattr(tail_pacer, "PACE_SLICE_BYTES", sum(SIZES) // tail_pacer.PACE_DEPTH - 1)
    prefetch.hold_tail(sched, tail)
    assert not prefetch.pace_tail(sched) and sched.ahead.pacer is not None
    prefetch.launch_tail(sched)
