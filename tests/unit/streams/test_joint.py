"""An ingress record whose outputs leave in several deliveries (the router's own, and those of
an encoder co-located in its process) is finished once, after the last one reached the
broker, and never when one was dropped or the partition was revoked meanwhile.

The I/O below stands in for ``StageIO``'s two calls the joint uses (``deliver`` and
``finish``): what is tested is the bookkeeping, not Kafka."""

import asyncio

from streams.runtime.produce import out_map
from streams.runtime.joint import Joint


class Deliveries:
    def __init__(self) -> None:
        self.epoch = 0
        self.sent: list[tuple[list, asyncio.Future]] = []
        self.finished: list[str] = []
        self.epochs: list[int | None] = []

    def deliver(self, outs, inputs=(), epoch=None):
        done = asyncio.get_running_loop().create_future()
        self.sent.append((list(outs), done))
        self.epochs.append(epoch)
        return done

    def finish(self, inputs):
        self.finished.extend(inputs)

    def land(self, i: int, ok: bool = True) -> None:
        self.sent[i][1].set_result(ok)


def out(name: str):
    return out_map("t", name, {"v": name})


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_finished_once_after_the_last_delivery_and_the_seal() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@5")
    joint.send([out("manifest")])
    later = joint.expect()
    io.land(0)
    joint.seal()
    await settle()
    assert io.finished == []  # the encoder's answer is not with the broker yet
    later(out("part"))
    assert [o.key for o in io.sent[1][0]] == [b"part"]  # after the manifest, in its own delivery
    io.land(1)
    await settle()
    assert io.finished == ["ingress@5"]
    joint._check()  # noqa: SLF001 - a late check finishes nothing twice
    assert io.finished == ["ingress@5"]


async def test_not_finished_before_the_seal_even_when_everything_landed() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@6")
    joint.send([out("manifest")])
    io.land(0)
    await settle()
    assert io.finished == []
    joint.seal()
    assert io.finished == ["ingress@6"]


async def test_an_offer_not_taken_is_not_waited_for() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@7")
    joint.send([out("manifest")])
    joint.expect()
    joint.unexpect()  # the encoder had no room: the job went through its topic instead
    joint.send([out("job")])
    io.land(0)
    io.land(1)
    joint.seal()
    await settle()
    assert io.finished == ["ingress@7"]


async def test_a_dropped_delivery_leaves_the_record_for_its_next_owner() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@8")
    joint.send([out("manifest")])
    later = joint.expect()
    joint.seal()
    io.land(0, ok=False)  # revoked while in flight: StageIO dropped it
    later(out("part"))
    io.land(1)
    await settle()
    assert io.finished == []


async def test_a_revoke_between_deliveries_leaves_the_record_unfinished() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@9")
    joint.send([out("manifest")])
    later = joint.expect()
    joint.seal()
    io.land(0)
    await settle()
    io.epoch += 1  # the partition went to another replica and may have come back
    later(out("part"))
    assert io.epochs == [0, 0]  # sent under the record's assignment: StageIO drops it, never sends it
    io.land(1, ok=False)
    await settle()
    assert io.finished == []


async def test_held_outputs_leave_with_the_answers_in_one_delivery() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@10")
    joint.hold([out("manifest")])
    first, second = joint.expect(), joint.expect()
    joint.seal()
    assert io.sent == []  # nothing leaves while an answer is due
    first(out("part0"))
    assert io.sent == []
    second(out("part1"))
    assert [[o.key for o in outs] for outs, _ in io.sent] == [[b"manifest", b"part0", b"part1"]]
    io.land(0)
    await settle()
    assert io.finished == ["ingress@10"]


async def test_answers_before_the_seal_wait_for_it() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@11")
    joint.hold([out("manifest")])
    joint.expect()(out("part"))  # answered inside the hand-over, before the router sealed
    assert io.sent == []
    joint.seal()
    assert [[o.key for o in outs] for outs, _ in io.sent] == [[b"manifest", b"part"]]


async def test_a_send_takes_what_is_held_first_and_ends_the_holding() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@12")
    joint.hold([out("manifest")])
    later = joint.expect()
    joint.expect()
    joint.unexpect()  # one job had no room: through its topic, now, and the manifest with it
    joint.send([out("job")])
    joint.seal()
    later(out("part"))
    assert [[o.key for o in outs] for outs, _ in io.sent] == [[b"manifest", b"job"], [b"part"]]
    io.land(0)
    await settle()
    assert io.finished == []  # the answer is not with the broker yet
    io.land(1)
    await settle()
    assert io.finished == ["ingress@12"]


async def test_held_outputs_with_no_answer_due_leave_at_the_seal() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@13")
    joint.hold([out("manifest")])
    joint.expect()
    joint.unexpect()
    assert io.sent == []
    joint.seal()
    assert [[o.key for o in outs] for outs, _ in io.sent] == [[b"manifest"]]
    io.land(0)
    await settle()
    assert io.finished == ["ingress@13"]


async def test_a_dropped_joint_delivery_leaves_the_record_for_its_next_owner() -> None:
    io = Deliveries()
    joint = Joint(io, "ingress@14")
    joint.hold([out("manifest")])
    later = joint.expect()
    joint.seal()
    later(out("part"))
    io.land(0, ok=False)  # revoked while in flight
    await settle()
    assert io.finished == []
