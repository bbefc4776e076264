"""Hold pages until released: the KV manager's deferred free and the scheduler's hold_kv API."""

from __future__ import annotations

import numpy as np
import pytest

from phasesched import DeterministicExecutor, Request, Scheduler, SchedulerConfig
from phasesched.errors import UnknownRequestError, UnknownTableError
from phasesched.kv import PagedKVManager


class TestDeferredFree:
    def test_marked_table_is_held_not_freed(self) -> None:
        """Freeing a table marked by defer_free keeps its pages, in place, until release."""
        kv = PagedKVManager(num_pages=8, page_size=4)
        slot = kv.open()
        kv.grow_to(slot, 10)
        pages = kv.pages(slot).copy()
        kv.defer_free(slot)
        kv.free_many(np.array([slot], dtype=np.int32))
        assert kv.is_held(slot)
        assert kv.num_free_pages == 5
        assert np.array_equal(kv.pages(slot), pages)
        kv.check_invariants()
        kv.release(slot)
        assert not kv.is_held(slot)
        assert kv.num_free_pages == 8
        kv.check_invariants()

    def test_unmarked_tables_free_as_before(self) -> None:
        """Only marked tables are held when several are freed at once."""
        kv = PagedKVManager(num_pages=8, page_size=4)
        a, b = kv.open(), kv.open()
        kv.grow_to(a, 4)
        kv.grow_to(b, 4)
        kv.defer_free(b)
        kv.free_many(np.array([a, b], dtype=np.int32))
        assert not kv.is_open(a)
        assert kv.is_held(b)
        assert kv.num_held_tables == 1

    def test_release_of_unheld_table_raises(self) -> None:
        """Releasing a table that is not held raises, changing nothing."""
        kv = PagedKVManager(num_pages=8, page_size=4)
        slot = kv.open()
        with pytest.raises(UnknownTableError):
            kv.release(slot)
        assert kv.is_open(slot)


class TestSchedulerHold:
    def _run(self, scheduler: Scheduler) -> list[str]:
        executor = DeterministicExecutor()
        finished: list[str] = []
        while scheduler.num_unfinished:
            plan = scheduler.schedule()
            finished += [f.request_id for f in scheduler.update(plan, executor.execute(plan)).finished]
        return finished

    def test_finished_request_keeps_its_pages_until_released(self) -> None:
        """A request marked hold_kv leaves its prompt's pages held when it finishes; release_kv frees them."""
        scheduler = Scheduler(SchedulerConfig(num_pages=16, page_size=4))
        scheduler.add_request(Request("a", prompt_token_ids=list(range(1, 11)), max_new_tokens=1))
        scheduler.add_request(Request("b", prompt_token_ids=[1, 2, 3], max_new_tokens=1))
        scheduler.hold_kv("a")
        assert sorted(self._run(scheduler)) == ["a", "b"]
        held = scheduler.held_kv("a")
        assert (held.num_tokens, len(held.pages)) == (10, 3)
        assert scheduler.held_request_ids == ("a",)
        assert scheduler.kv.num_used_pages == 3
        scheduler.check_invariants()
        scheduler.release_kv("a")
        assert scheduler.kv.num_used_pages == 0
        scheduler.check_invariants()
        with pytest.raises(UnknownRequestError):
            scheduler.release_kv("a")

    def test_abort_frees_at_once(self) -> None:
        """An aborted request's pages are freed, not held, even when it asked for a hold."""
        scheduler = Scheduler(SchedulerConfig(num_pages=16, page_size=4))
        scheduler.add_request(Request("a", prompt_token_ids=list(range(1, 11)), max_new_tokens=4))
        scheduler.hold_kv("a")
        plan = scheduler.schedule()
        scheduler.update(plan, DeterministicExecutor().execute(plan))
        scheduler.abort("a")
        assert scheduler.held_request_ids == ()
        assert scheduler.kv.num_used_pages == 0
        scheduler.check_invariants()
