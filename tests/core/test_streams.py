"""``backends.streams`` answers as ``torch.cuda``'s own helpers do (GPU): the current stream inside
and outside a stream context, a switch and back, an event recorded on one stream and waited for on
another."""

from __future__ import annotations

import pytest
import torch

from esamp.core.backends import streams

pytestmark = pytest.mark.cuda


def test_current_is_torchs_current_stream_and_switch_sets_it():
    device = torch.cuda.current_device()
    main = torch.cuda.current_stream()
    assert streams.current(device) == main
    assert streams.current(device) is streams.current(device)  # one object per stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert streams.current(device) == side == torch.cuda.current_stream()
    assert streams.current(device) == main
    streams.switch(side)
    try:
        assert torch.cuda.current_stream() == side
    finally:
        streams.switch(main)
    assert torch.cuda.current_stream() == main


def test_an_event_recorded_on_one_stream_orders_another():
    device = torch.cuda.current_device()
    main, side = streams.current(device), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    done = torch.cuda.Event()
    streams.switch(side)
    try:
        for _ in range(50):
            x.add_(1)  # long enough to be in flight when main queues its read
        streams.record(done, side)
    finally:
        streams.switch(main)
    streams.wait(main, done)
    total = x.sum()  # queued on main after the wait
    assert total.item() == 50 * (1 << 20)
    assert done.query()
