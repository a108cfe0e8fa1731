"""The `kv` policy's view of the workers' caches (routing/kv_index.py) and the ordering of
their KV event messages (routing/kv_feed.KvSequencer), in process: no NATS, a snapshot
source written by hand."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from genmesh.routing.kv_feed import KvSequencer, Snapshot
from genmesh.routing.kv_index import KvIndex, PredictedCache
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
    KvEventError,
    KvEventsMessage,
    block_keys,
)

pytestmark = pytest.mark.unit

BS = 4
# Two prompts of four blocks sharing their first two.
A = list(range(100, 116))
B = A[:8] + list(range(200, 208))


def keys(tokens: list[int]) -> list[int]:
    return block_keys(TokenIds(tokens), BS)


def stored(
    tokens: list[int],
    hashes: list[EngineHash],
    parent: EngineHash | None = None,
    medium: str | None = None,
) -> BlockStored:
    return BlockStored(hashes, parent, TokenIds(tokens), BS, medium=medium)


def chain(tokens: list[int], tag: str) -> list[KvEvent]:
    """`tokens` stored block by block as an engine does, hashes `tag0`, `tag1`, ..."""
    events: list[KvEvent] = []
    for i in range(len(tokens) // BS):
        parent = None if i == 0 else f"{tag}{i - 1}".encode()
        events.append(stored(tokens[i * BS : (i + 1) * BS], [f"{tag}{i}".encode()], parent))
    return events


def test_overlap_is_the_run_of_leading_blocks_each_worker_holds() -> None:
    index = KvIndex()
    index.apply("w1", chain(A, "a"))
    index.apply("w2", [stored(B[:8], [1, 2]), stored(B[8:], [3, 4], parent=2)])
    assert index.overlaps(keys(A)) == {"w1": 4, "w2": 2}
    assert index.overlaps(keys(B)) == {"w1": 2, "w2": 4}
    assert index.overlaps(keys(B[:6])) == {"w1": 1, "w2": 1}  # one full block of six tokens
    assert index.overlaps(keys(list(range(16)))) == {}
    assert index.keys_held == 6  # A's four, B's last two


def test_events_interleaved_across_workers_give_the_same_index() -> None:
    per_worker = {"w1": chain(A, "a"), "w2": chain(B, "b"), "w3": chain(A[:8], "c")}
    expected = {"w1": 4, "w2": 2, "w3": 2}
    for order in itertools.permutations(per_worker):
        index = KvIndex()
        streams = {w: iter(per_worker[w]) for w in order}
        while streams:  # one event of each worker in turn
            for worker in list(streams):
                event = next(streams[worker], None)
                if event is None:
                    del streams[worker]
                else:
                    index.apply(worker, [event])
        assert index.overlaps(keys(A)) == expected


def test_a_removed_block_ends_the_overlap_there() -> None:
    index = KvIndex()
    index.apply("w1", chain(A, "a"))
    index.apply("w1", [BlockRemoved([b"a2"])])
    assert index.overlaps(keys(A)) == {"w1": 2}
    # Its child is still held, and a stored child of the child still chains from it.
    index.apply("w1", [BlockRemoved([b"a0"])])
    assert index.overlaps(keys(A)) == {}
    index.apply("w1", [stored(A[:4], [b"a0"])])
    assert index.overlaps(keys(A)) == {"w1": 2}


def test_removals_of_unknown_hashes_and_other_media_change_nothing() -> None:
    index = KvIndex()
    index.apply("w1", chain(A, "a"))
    index.apply("w1", [BlockRemoved([b"zz", 5]), BlockRemoved([b"a0"], medium="CPU")])
    assert index.overlaps(keys(A)) == {"w1": 4}
    index.apply("w2", [stored(A[:8], [1, 2], medium="CPU")])  # offloaded: not counted
    assert index.overlaps(keys(A)) == {"w1": 4}
    index.apply("w2", [stored(A[:8], [1, 2], medium="GPU")])
    assert index.overlaps(keys(A)) == {"w1": 4, "w2": 2}


def test_cleared_empties_one_worker() -> None:
    index = KvIndex()
    index.apply("w1", chain(A, "a"))
    index.apply("w2", chain(A, "b"))
    index.apply("w1", [AllBlocksCleared()])
    assert index.overlaps(keys(A)) == {"w2": 4}
    assert index.blocks_of("w1") == 0
    index.apply("w1", [AllBlocksCleared(), *chain(A[:4], "a")])  # events after it apply
    assert index.overlaps(keys(A)) == {"w1": 1, "w2": 4}


def test_a_dropped_worker_is_forgotten_and_its_slot_reused_clean() -> None:
    index = KvIndex()
    index.apply("w1", chain(A, "a"))
    index.apply("w2", chain(B, "b"))
    index.drop("w1")
    assert index.overlaps(keys(A)) == {"w2": 2}
    assert index.workers() == ["w2"]
    index.apply("w3", [])  # takes w1's slot
    assert index.overlaps(keys(A)) == {"w2": 2}
    index.drop("w2")
    assert index.keys_held == 0


def test_a_block_whose_parent_is_unknown_is_skipped_and_counted() -> None:
    index = KvIndex()
    index.apply("w1", [stored(A[4:8], [b"a1"], parent=b"a0"), stored(A[8:12], [b"a2"], b"a1")])
    assert index.orphans == 2  # the second's parent was itself skipped
    assert index.overlaps(keys(A)) == {}
    assert index.blocks_of("w1") == 0
    index.apply("w1", chain(A, "a"))  # stored again in full: indexed
    assert index.overlaps(keys(A)) == {"w1": 4}


def test_the_same_block_under_two_engine_hashes_is_held_until_both_are_removed() -> None:
    index = KvIndex()
    index.apply("w1", [stored(A[:4], [1]), stored(A[:4], [2])])  # e.g. two LoRA ids
    index.apply("w1", [BlockRemoved([1])])
    assert index.overlaps(keys(A)) == {"w1": 1}
    index.apply("w1", [BlockRemoved([2])])
    assert index.overlaps(keys(A)) == {}


def test_an_engine_hash_stored_again_with_other_tokens_moves() -> None:
    index = KvIndex()
    index.apply("w1", [stored(A[:4], [1])])
    index.apply("w1", [stored(B[8:12], [1])])  # the engine reused hash 1
    assert index.overlaps(keys(A)) == {}
    assert index.blocks_of("w1") == 1


# -- predicted caches (approximate mode) ----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_prediction_lasts_its_ttl_from_the_last_time_it_was_routed() -> None:
    clock = Clock()
    cache = PredictedCache(ttl=10.0, clock=clock)
    cache.record("w1", keys(A))
    clock.now += 6
    cache.record("w2", keys(B))
    cache.record("w1", keys(A[:8]))  # refreshes A's first two blocks only
    assert cache.overlaps(keys(A)) == {"w1": 4, "w2": 2}
    clock.now += 4  # A's last two blocks expire (10 s after they were routed)
    assert cache.overlaps(keys(A)) == {"w1": 2, "w2": 2}
    clock.now += 6  # all of w1's and w2's expire
    assert cache.overlaps(keys(A)) == {}
    assert cache.keys_held == 0


def test_a_dropped_worker_takes_its_predictions_along() -> None:
    cache = PredictedCache(ttl=10.0, clock=Clock())
    cache.record("w1", keys(A))
    cache.record("w2", keys(A))
    cache.drop("w1")
    assert cache.overlaps(keys(A)) == {"w2": 4}


# -- message order, gaps, resync ------------------------------------------------------------


def message(seq: int, *events: KvEvent, worker: str = "w1") -> KvEventsMessage:
    return KvEventsMessage(worker, seq, float(seq), list(events))


# A's four blocks, one per message, then the removal of the last: seq 1..5.
MESSAGES = [message(i + 1, e) for i, e in enumerate(chain(A, "a"))] + [
    message(5, BlockRemoved([b"a3"]))
]


class Snapshots:
    """A worker's snapshot source: answers what it is given, when the test says."""

    def __init__(self, *answers: Snapshot | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, worker: str) -> Snapshot:
        self.asked.append(worker)
        await self.release.wait()
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def settled(sequencer: KvSequencer, worker: str = "w1") -> None:
    for _ in range(100):
        if not sequencer.resyncing(worker):
            return
        await asyncio.sleep(0)
    raise AssertionError("resync did not finish")


async def test_messages_in_order_are_applied_and_duplicates_dropped() -> None:
    snapshots = Snapshots()
    sequencer = KvSequencer(KvIndex(), snapshots)
    for m in [*MESSAGES[:3], MESSAGES[1], MESSAGES[2], MESSAGES[3]]:
        sequencer.receive(m)
    assert sequencer.index.overlaps(keys(A)) == {"w1": 4}
    assert sequencer.last_applied("w1") == 4
    assert snapshots.asked == []


async def test_a_gap_resyncs_from_the_snapshot_and_applies_what_follows_it() -> None:
    # The worker's cache as of message 3: A's first three blocks.
    snapshots = Snapshots((3, [stored(A[:12], [b"a0", b"a1", b"a2"])]))
    sequencer = KvSequencer(KvIndex(), snapshots)
    sequencer.receive(MESSAGES[0])
    sequencer.receive(MESSAGES[3])  # 2 and 3 lost
    assert sequencer.resyncing("w1")
    await settled(sequencer)
    assert snapshots.asked == ["w1"]
    assert sequencer.last_applied("w1") == 4
    assert sequencer.index.overlaps(keys(A)) == {"w1": 4}
    sequencer.receive(MESSAGES[4])
    assert sequencer.index.overlaps(keys(A)) == {"w1": 3}


async def test_out_of_order_messages_resync_rather_than_apply_out_of_order() -> None:
    snapshots = Snapshots((3, [stored(A[:12], [b"a0", b"a1", b"a2"])]))
    sequencer = KvSequencer(KvIndex(), snapshots)
    sequencer.receive(MESSAGES[0])
    sequencer.receive(MESSAGES[2])
    sequencer.receive(MESSAGES[1])  # late: buffered during the resync, then dropped
    await settled(sequencer)
    assert sequencer.last_applied("w1") == 3
    assert sequencer.index.overlaps(keys(A)) == {"w1": 3}


async def test_first_contact_after_message_one_resyncs() -> None:
    snapshots = Snapshots((40, [stored(A[:8], [7, 8])]))
    sequencer = KvSequencer(KvIndex(), snapshots)
    sequencer.receive(message(41, stored(A[8:12], [9], parent=8)))
    await settled(sequencer)
    assert sequencer.index.overlaps(keys(A)) == {"w1": 3}
    assert sequencer.last_applied("w1") == 41


async def test_live_messages_racing_a_resync_are_buffered_and_applied_past_its_seq() -> None:
    snapshots = Snapshots((3, [stored(A[:12], [b"a0", b"a1", b"a2"])]))
    snapshots.release.clear()
    sequencer = KvSequencer(KvIndex(), snapshots)
    sequencer.receive(MESSAGES[0])
    sequencer.receive(MESSAGES[2])  # gap: resync starts, its snapshot held back
    await asyncio.sleep(0)
    # While the snapshot is on its way: messages it already covers, and later ones.
    for m in (MESSAGES[1], MESSAGES[3], MESSAGES[2], MESSAGES[4]):
        sequencer.receive(m)
    sequencer.receive(message(2, worker="w1"))  # a duplicate in the buffer
    sequencer.receive(message(6, BlockRemoved([b"a0"])))
    sequencer.receive(message(3, BlockRemoved([b"a0"])))  # covered by the snapshot
    assert sequencer.index.overlaps(keys(A)) == {"w1": 1}  # untouched meanwhile
    snapshots.release.set()
    await settled(sequencer)
    assert snapshots.asked == ["w1"]  # one resync, however many messages came meanwhile
    assert sequencer.last_applied("w1") == 6
    assert sequencer.index.overlaps(keys(A)) == {}  # 4 stored a3, 5 removed it, 6 a0
    assert sequencer.index.blocks_of("w1") == 2


async def test_a_gap_among_the_buffered_messages_resyncs_again() -> None:
    snapshots = Snapshots(
        (2, [stored(A[:8], [b"a0", b"a1"])]),
        (4, [stored(A, [b"a0", b"a1", b"a2", b"a3"])]),
    )
    snapshots.release.clear()
    sequencer = KvSequencer(KvIndex(), snapshots)
    sequencer.receive(MESSAGES[1])  # first contact at 2
    await asyncio.sleep(0)
    sequencer.receive(MESSAGES[3])  # 3 lost as well
    snapshots.release.set()
    await settled(sequencer)
    assert snapshots.asked == ["w1", "w1"]
    assert sequencer.last_applied("w1") == 4
    assert sequencer.index.overlaps(keys(A)) == {"w1": 4}


async def test_without_a_snapshot_the_worker_is_followed_from_its_live_messages() -> None:
    snapshots = Snapshots(TimeoutError(), TimeoutError())
    sequencer = KvSequencer(KvIndex(), snapshots)
    for m in MESSAGES[:2]:
        sequencer.receive(m)
    sequencer.receive(MESSAGES[3])  # 3 lost: no snapshot to be had
    await settled(sequencer)
    assert snapshots.asked == ["w1", "w1"]  # asked twice
    assert sequencer.resync_failures == 1
    # Emptied (what it held is uncertain), then message 4 applied: a3's parent a2 is
    # unknown, so nothing is reachable until the worker stores a prefix again.
    assert sequencer.index.overlaps(keys(A)) == {}
    assert sequencer.last_applied("w1") == 4
    sequencer.receive(message(5, *chain(A[:8], "a")))
    assert sequencer.index.overlaps(keys(A)) == {"w1": 2}


async def test_seq_one_again_means_a_new_relay_and_a_new_cache() -> None:
    sequencer = KvSequencer(KvIndex(), Snapshots())
    for m in MESSAGES[:4]:
        sequencer.receive(m)
    sequencer.receive(message(1, *chain(B[:8], "b")))
    assert sequencer.index.overlaps(keys(A)) == {"w1": 2}
    assert sequencer.index.overlaps(keys(B)) == {"w1": 2}
    assert sequencer.last_applied("w1") == 1


async def test_a_worker_dropped_mid_resync_is_forgotten() -> None:
    snapshots = Snapshots((3, [stored(A[:12], [b"a0", b"a1", b"a2"])]))
    snapshots.release.clear()
    index = KvIndex()
    sequencer = KvSequencer(index, snapshots)
    sequencer.receive(MESSAGES[0])
    sequencer.receive(MESSAGES[2])
    await asyncio.sleep(0)
    sequencer.drop("w1")
    index.drop("w1")
    snapshots.release.set()
    await asyncio.sleep(0.01)
    assert index.overlaps(keys(A)) == {}
    assert sequencer.last_applied("w1") == 0
    await sequencer.close()


def test_a_prediction_holds_no_more_than_the_workers_cache() -> None:
    cache = PredictedCache(ttl=10.0, clock=Clock())
    cache.record("w1", keys(A), capacity=5)
    cache.record("w1", keys(B), capacity=5)  # A's first two are B's: refreshed, not added
    assert cache.overlaps(keys(B)) == {"w1": 4}
    assert cache.overlaps(keys(A)) == {"w1": 2}  # A's third, least recently routed, went
    cache.record("w1", keys(A[:4]), capacity=3)  # B's last two and the first are left
    assert cache.overlaps(keys(A)) == {"w1": 1}
    assert cache.overlaps(keys(B)) == {"w1": 1}
    assert cache.keys_held == 3


async def test_a_refused_snapshot_is_asked_for_again() -> None:
    # e.g. the relay's "no snapshot <id> (expired, ...)" for a later page
    snapshots = Snapshots(KvEventError("refused"), (3, [stored(A[:12], [b"a0", b"a1", b"a2"])]))
    sequencer = KvSequencer(KvIndex(), snapshots)
    sequencer.receive(MESSAGES[2])
    await settled(sequencer)
    assert snapshots.asked == ["w1", "w1"]
    assert sequencer.resync_failures == 0
    assert sequencer.index.overlaps(keys(A)) == {"w1": 3}
