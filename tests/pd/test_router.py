"""The P/D router and mailbox, without processes: routing, retries, liveness, exactly-once endings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phasesched import Request
from phasesched.pd import Mailbox, Manifest, Router, WorkerLoad, WorkerStatus, pick_worker, pick_worker_by
from phasesched.pd.protocol import Decode, Finished, Prefill, Pull, Release, Shutdown, TransferFailed


class DictStore:
    """An in-memory stand-in for torch.distributed.TCPStore (the five methods the mailbox uses)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        """Store a value."""
        self.data[key] = value

    def get(self, key: str) -> bytes:
        """Read a value."""
        return self.data[key]

    def add(self, key: str, value: int) -> int:
        """Add to a counter."""
        count = int(self.data.get(key, b"0")) + value
        self.data[key] = str(count).encode()
        return count

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists."""
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        """Delete a key."""
        return self.data.pop(key, None) is not None


def _manifest(request_id: str, attempt: int, src: int = 0) -> Manifest:
    return Manifest(request_id, attempt, src, 8, 2, 4, "NHD", "float32", (1, 2), 8, "x", 0.0, 0.0)


def _statuses(*ranks: int, seq: int = 1) -> dict[int, WorkerStatus]:
    return {r: WorkerStatus(seq, 100, 0, 4) for r in ranks}


class TestRouting:
    def test_room_before_load(self) -> None:
        """A worker with room wins over a less loaded one without, as in the simulator."""
        workers = [WorkerLoad(0, load=0, free_pages=1, page_size=4), WorkerLoad(1, load=9, free_pages=8, page_size=4)]
        assert pick_worker(workers, 16) == 1
        assert pick_worker(workers, 4) == 0

    @given(
        st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6), st.integers(0, 2)), min_size=1, max_size=6),
        st.integers(1, 40),
    )
    def test_asking_for_room_in_load_order_picks_as_the_rule_says(
        self, rows: list[tuple[int, int, int]], num_tokens: int
    ) -> None:
        """pick_worker_by, asking room lazily, picks the worker with room, then fewest requests, then lowest index."""
        workers = [WorkerLoad(i, load, free, watermark, page_size=4) for i, (load, free, watermark) in enumerate(rows)]
        rule = min(workers, key=lambda w: (not w.has_room(num_tokens), w.load, w.index)).index
        asked: list[int] = []

        def has_room(index: int) -> bool:
            asked.append(index)
            return workers[index].has_room(num_tokens)

        assert pick_worker_by([(w.load, w.index) for w in workers], has_room) == rule
        assert pick_worker(workers, num_tokens) == rule
        assert len(asked) == len(set(asked))  # each worker asked at most once
        if workers[rule].has_room(num_tokens):
            assert asked[-1] == rule  # nobody asked after the answer

    def test_no_worker_is_an_error(self) -> None:
        """Routing among no workers raises."""
        with pytest.raises(ValueError, match="no worker"):
            pick_worker_by([], lambda index: True)


class TestMailbox:
    def test_messages_arrive_in_order_once(self) -> None:
        """Messages sent to a rank are received in order, each once."""
        store = DictStore()
        sender, receiver = Mailbox(store, 0), Mailbox(store, 1)
        sender.send(1, Release("a", 0))
        sender.send(1, Shutdown())
        assert receiver.receive() == [Release("a", 0), Shutdown()]
        assert receiver.receive() == []

    def test_claimed_but_unwritten_message_is_skipped_after_the_gap_timeout(self) -> None:
        """A sequence number whose sender died before writing it does not block the queue forever."""
        store, clock = DictStore(), [0.0]
        receiver = Mailbox(store, 1, clock=lambda: clock[0], gap_timeout_s=1.0)
        store.add("pd/mb/1/tail", 1)  # claimed, never written
        Mailbox(store, 0).send(1, Shutdown())
        assert receiver.receive() == []
        clock[0] = 2.0
        assert receiver.receive() == [Shutdown()]


class TestRouter:
    def _router(self, **kwargs: float) -> Router:
        requests = [Request("a", prompt_len=8, max_new_tokens=2), Request("b", prompt_len=8, max_new_tokens=2)]
        return Router(requests, [0], [1, 2], start=0.0, peer_timeout_s=1.0, **kwargs)  # type: ignore[arg-type]

    def test_happy_path_ends_each_request_once(self) -> None:
        """Arrival -> Prefill, Manifest -> Decode on the less loaded worker, Finished -> done, then Shutdown."""
        router = self._router()
        out = router.tick(0.0, _statuses(0, 1, 2))
        assert [type(m) for _, m in out] == [Prefill, Prefill]
        (rank_a, decode_a), (src, pull) = router.on_message(_manifest("a", 0), 0.1)
        assert src == 0
        assert isinstance(pull, Pull)
        assert pull.dst_rank == rank_a
        ((rank_b, _), _) = router.on_message(_manifest("b", 0), 0.1)
        assert isinstance(decode_a, Decode)
        assert {rank_a, rank_b} == {1, 2}
        for rid, rank in (("a", rank_a), ("b", rank_b)):
            router.on_message(Finished(rid, 0, rank, "length", (1, 2), 0.2, 0.3, 0), 0.3)
        router.on_message(Finished("a", 0, rank_a, "length", (9, 9), 0.2, 0.3, 0), 0.3)  # a duplicate
        assert router.done
        assert router.outcomes["a"].finished is not None
        assert router.outcomes["a"].finished.output_token_ids == (1, 2)
        assert all(isinstance(m, Shutdown) for _, m in router.tick(0.4, _statuses(0, 1, 2, seq=2)))

    def test_lazy_send_leaves_the_pull_to_the_decode_worker(self) -> None:
        """Without eager sends the router only queues the request on a decode worker (NCCL's ordering)."""
        router = Router([Request("a", prompt_len=8)], [0], [1], start=0.0, eager_send=False)
        router.tick(0.0, _statuses(0, 1))
        ((rank, decode),) = router.on_message(_manifest("a", 0), 0.1)
        assert rank == 1
        assert isinstance(decode, Decode)
        assert not decode.eager

    def test_failed_transfer_reprefills_and_releases(self) -> None:
        """A failed transfer releases the prefill side's pages and starts the next attempt."""
        router = self._router()
        router.tick(0.0, _statuses(0, 1, 2))
        router.on_message(_manifest("a", 0), 0.1)
        out = router.on_message(TransferFailed("a", 0, 1, "checksum mismatch"), 0.2)
        assert (0, Release("a", 0)) in out
        assert any(isinstance(m, Prefill) and m.attempt == 1 for _, m in out)
        assert router.on_message(_manifest("a", 0), 0.3) == [(0, Release("a", 0))]  # stale: only released

    def test_silent_decode_worker_is_declared_dead(self) -> None:
        """A decode worker whose status stops changing is dead; its requests start over, the rest go on."""
        router = self._router()
        router.tick(0.0, _statuses(0, 1, 2))
        ((rank, _), _) = router.on_message(_manifest("a", 0), 0.1)
        alive = 3 - rank
        out = router.tick(1.5, {0: WorkerStatus(2, 100, 0, 4), alive: WorkerStatus(2, 100, 0, 4)})
        assert router.dead == {rank}
        assert any(isinstance(m, Prefill) and m.request.request_id == "a" and m.attempt == 1 for _, m in out)
        ((again, _), _) = router.on_message(_manifest("a", 1), 1.6)
        assert again == alive

    def test_gives_up_after_max_attempts(self) -> None:
        """A request that fails every attempt ends failed, with every reason kept."""
        router = Router([Request("a", prompt_len=8)], [0], [1], start=0.0, max_attempts=2)
        router.tick(0.0, _statuses(0, 1))
        for attempt in range(2):
            router.on_message(_manifest("a", attempt), 0.1)
            router.on_message(TransferFailed("a", attempt, 1, "dropped"), 0.2)
        outcome = router.outcomes["a"]
        assert outcome.done
        assert outcome.state.value == "failed"
        assert len(outcome.errors) == 3
        assert "gave up" in outcome.errors[-1]
