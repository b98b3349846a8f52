"""Held outputs: taken back whole by a later output, or sent together once their time came.
The clock is the test's; the timer's own firing is checked once, with a short delay."""

import asyncio

from streams.runtime.linger import Linger, take
from streams.runtime.produce import out_map


def out(name: str):
    return out_map("t", name, {"v": name})


class Clock:
    def __init__(self) -> None:
        self.ms = 1000.0

    def __call__(self) -> float:
        return self.ms


async def test_an_output_taken_back_in_time_is_never_sent() -> None:
    sent: list[list] = []
    clock = Clock()
    linger = Linger(50.0, sent.append, clock)
    held = linger.hold(out("accepted"))
    assert take(held).key == b"accepted"
    assert take(held) is None  # taken once
    clock.ms += 100
    linger._flush()  # noqa: SLF001 - the timer's call, at the test's time
    assert sent == [] and len(linger) == 0


async def test_outputs_whose_time_came_go_together_and_the_rest_later() -> None:
    sent: list[list] = []
    clock = Clock()
    linger = Linger(50.0, sent.append, clock)
    linger.hold(out("a"))
    linger.hold(out("b"))
    clock.ms += 20
    late = linger.hold(out("c"))  # due 20 ms after the others
    clock.ms += 30
    linger._flush()  # noqa: SLF001
    assert [[o.key for o in outs] for outs in sent] == [[b"a", b"b"]]
    assert len(linger) == 1
    clock.ms += 20
    linger._flush()  # noqa: SLF001
    assert [[o.key for o in outs] for outs in sent] == [[b"a", b"b"], [b"c"]]
    assert take(late) is None


async def test_a_taken_output_at_the_head_does_not_hold_back_the_others() -> None:
    sent: list[list] = []
    clock = Clock()
    linger = Linger(50.0, sent.append, clock)
    first = linger.hold(out("first"))
    clock.ms += 10
    linger.hold(out("second"))
    take(first)
    clock.ms += 50
    linger._flush()  # noqa: SLF001
    assert [[o.key for o in outs] for outs in sent] == [[b"second"]]


async def test_the_timer_sends_what_is_held_without_another_call() -> None:
    sent: list[list] = []
    linger = Linger(5.0, sent.append)
    linger.hold(out("a"))
    for _ in range(200):  # up to 2 s on a busy machine
        if sent:
            break
        await asyncio.sleep(0.01)
    assert [[o.key for o in outs] for outs in sent] == [[b"a"]]


async def test_with_no_delay_an_output_is_sent_at_once() -> None:
    sent: list[list] = []
    linger = Linger(0.0, sent.append)
    assert linger.hold(out("a")) is None
    assert [[o.key for o in outs] for outs in sent] == [[b"a"]] and len(linger) == 0
