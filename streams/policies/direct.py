"""Direct answers: which requests the router answers itself, without the assembler's hop.

An embed request with one part that the router's own encoder takes (``router.colocate``: a
text by default) has nothing to assemble: its answer is its one encoded part. The router can
send that answer itself, with a done marker of its own (``<prefix>.router.done``,
partitioned like its ingress), and skip the assembler's fetch, produce and process
(``router.answer_local``).
Everything else goes the assembler's way, as before.

Two stages may now answer requests with the same key, so each must know what the other
did. The rule is that a key the router has seen stays with whoever took it first:

- a key the router answered itself: a record with the same digest is a duplicate (dropped,
  nothing sent); another digest reuses the id (its own ``invalid_request``), as the
  assembler would answer it;
- a key the router sent the assembler's way (a manifest, or a verdict of its own) goes on
  that way, and the assembler answers a duplicate or a reused id as before;
- a record being replayed after a take-over (below the partition's end offset when this
  replica took it over) is never answered directly: the last owner may have sent it the
  assembler's way. One whose terminal event is already on its reply topic was answered
  (by either stage) and is dropped; one marked done by the router too;
- after a take-over of a partition that had records within the retention, nothing of it is
  answered directly for one retention (``direct_from``): the keys the last owner sent the
  assembler's way are not in the router's markers, so until they are too old to matter
  every request of that partition goes the assembler's way, and the assembler, which knows
  them, answers duplicates and reused ids.

Pure: the stage keeps a ``Ledger`` per ingress partition index (the shared and every tenant's
ingress topics alike: a key names its tenant, so keys never collide) and carries the
decisions out. What it shares with the assembler's take-over (docs/reliability.md): a
terminal event found on a reply topic is matched by id, not by the record it answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from streams.policies.assembly import same_record


class Action(StrEnum):
    DIRECT = "direct"
    """Answer it here once the router's encoder has answered its part."""
    ASSEMBLER = "assembler"
    """Send it the assembler's way (its manifest and jobs), as every request went before."""
    DROP = "drop"
    """A duplicate of a request already answered: finish its record, send nothing."""
    REUSED = "reused"
    """Another request with the id of one the router answered: its own ``invalid_request``."""


class Seen(NamedTuple):
    at_ms: float
    digest: str | None
    direct: bool
    """Answered (or being answered) by the router itself."""


def decide(prev: Seen | None, digest: str | None, *, replayed: bool, answered_before: bool,
           eligible: bool) -> Action:
    """What to do with one routed request. ``prev``: what the ledger holds for its key;
    ``replayed``: its record is one this replica replays after a take-over, or comes while
    the partition is not answered directly yet (``Ledger.direct_from``);
    ``answered_before``: the take-over found its terminal event on its reply topic;
    ``eligible``: it qualifies for a direct answer (an embed request with one part,
    taken by the router's encoder)."""
    if prev is not None and prev.direct:
        return Action.DROP if same_record(prev.digest, digest) else Action.REUSED
    if prev is not None:
        return Action.ASSEMBLER
    if replayed:
        return Action.DROP if answered_before else Action.ASSEMBLER
    return Action.DIRECT if eligible else Action.ASSEMBLER


@dataclass
class Ledger:
    """What the router knows of the keys of one ingress partition index: at most ``max_keys``,
    each for ``retention_ms`` (the assembler's retention), oldest forgotten first."""

    retention_ms: float
    max_keys: int
    seen: dict[str, Seen] = field(default_factory=dict)
    replay_end: dict[str, int] = field(default_factory=dict)
    """Topic -> the offset below which its records are replays of the last owner's."""
    direct_from: dict[str, float] = field(default_factory=dict)
    """Topic -> when (epoch ms) its requests may be answered directly again after a take-over."""
    answered_before: set[str] = field(default_factory=set)
    """Keys of replayed records whose terminal event the take-over found on their reply topic."""

    def note(self, key: str, digest: str | None, now_ms: float, direct: bool) -> None:
        self.seen.pop(key, None)  # re-inserted last: the dict's order is age order
        self.seen[key] = Seen(now_ms, digest, direct)
        self.prune(now_ms)

    def prune(self, now_ms: float) -> None:
        cutoff = now_ms - self.retention_ms
        while self.seen:
            key, s = next(iter(self.seen.items()))
            if s.at_ms >= cutoff and len(self.seen) <= self.max_keys:
                break
            del self.seen[key]

    def decide(self, topic: str, key: str, digest: str | None, offset: int, eligible: bool,
               now_ms: float) -> Action:
        self.prune(now_ms)
        replayed = offset < self.replay_end.get(topic, 0) or now_ms < self.direct_from.get(topic, 0.0)
        return decide(self.seen.get(key), digest, replayed=replayed, answered_before=key in self.answered_before,
                      eligible=eligible)
