"""The tier driver's fetch book (``ems.server.fetches.FetchBook``) against a model, on a
real pool: a key is fetched by one request at a time and the others wait for that
fetch; a run ends at the first key that is neither in flight nor reservable; every
request's ``done`` runs exactly once, when the last fetch it waits for is finished,
never before; a finished fetch commits exactly its whole keys and aborts the others,
except the transfers still running (late), whose space stays reserved until they are
aborted; nothing is reserved that the model does not hold."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ems.pool.core import GrantStatus
from ems.server.fetches import Fetch, FetchBook
from ems.server.tenants import Tenant, TenantSpec

KEYS = [f"k{i}" for i in range(8)]
SIZE = 1000
OWNER = ("test", "fetch")
CLIENT = "client"


class FetchBookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tenant = Tenant(TenantSpec(None, None, 1 << 20), 60.0)
        self.book = FetchBook(OWNER)
        self.inflight: dict[str, int] = {}  # key -> the fetch bringing it
        self.fetches: dict[int, Fetch] = {}  # open fetches, by model id
        self.fetch_keys: dict[int, list[str]] = {}
        self.waiting: dict[int, set[int]] = {}  # request -> the open fetches it waits for
        self.done_calls: dict[int, int] = {}  # request -> how often its done ran
        self.late: dict[int, list[int]] = {}  # fetch -> indexes still reserved
        self.late_fetch: dict[int, Fetch] = {}
        self.committed: set[str] = set()
        self.busy: dict[str, int] = {}  # key -> the client's reservation token
        self.ids = 0

    def teardown(self) -> None:
        self.tenant.close()

    def reserved_late(self) -> set[str]:
        """Keys whose transfer outlived its fetch: still reserved, so not reservable."""
        return {self.late_fetch[fid].reserved[i].key
                for fid, indexes in self.late.items() for i in indexes}

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
    def plan(self, keys: list[str]) -> None:
        waits: set[int] = set()
        mine: list[str] = []
        taken = self.committed | set(self.busy) | self.reserved_late()
        for key in keys:  # the model's plan
            if key in self.inflight:
                waits.add(self.inflight[key])
            elif key in taken:
                break
            else:
                mine.append(key)
        self.ids += 1
        request = self.ids
        started: list[Fetch] = []
        self.done_calls[request] = 0

        def done() -> None:
            assert not self.waiting.get(request), (request, self.waiting.get(request))
            self.done_calls[request] += 1

        handled = self.book.plan(self.tenant, keys, [SIZE] * len(keys), done, started.append)
        assert handled == bool(waits or mine)
        if mine:
            assert len(started) == 1 and [r.key for r in started[0].reserved] == mine
            self.ids += 1
            self.fetches[self.ids] = started[0]
            self.fetch_keys[self.ids] = mine
            for key in mine:
                self.inflight[key] = self.ids
            waits.add(self.ids)
        else:
            assert started == []
        if handled:
            self.waiting[request] = waits
        else:
            del self.done_calls[request]

    @precondition(lambda self: self.fetches)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        fid = data.draw(st.sampled_from(sorted(self.fetches)))
        fetch, keys = self.fetches.pop(fid), self.fetch_keys.pop(fid)
        ok = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
        late = [i for i in range(len(keys)) if not ok[i] and data.draw(st.booleans())]
        for waits in self.waiting.values():  # before: the done callbacks check it
            waits.discard(fid)
        self.book.finish(fetch, ok, late)
        for i, key in enumerate(keys):
            del self.inflight[key]
            if ok[i]:
                self.committed.add(key)
        if late:
            self.late[fid], self.late_fetch[fid] = late, fetch
        for request, waits in list(self.waiting.items()):
            if not waits:
                assert self.done_calls[request] == 1
                del self.waiting[request]

    @precondition(lambda self: self.late)
    @rule(data=st.data())
    def late_transfer_returns(self, data: st.DataObject) -> None:
        fid = data.draw(st.sampled_from(sorted(self.late)))
        self.book.abort_late(self.late_fetch.pop(fid), self.late.pop(fid))

    @rule(key=st.sampled_from(KEYS))
    def a_client_reserves(self, key: str) -> None:
        grant = self.tenant.pool.reserve([key], [SIZE], CLIENT)[0]
        taken = set(self.inflight) | self.committed | set(self.busy) | self.reserved_late()
        free = key not in taken
        assert (grant.status is GrantStatus.NEW) == free
        if free:
            self.busy[key] = grant.token

    @precondition(lambda self: self.busy)
    @rule(data=st.data())
    def the_client_commits(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.busy)))
        assert self.tenant.pool.commit([self.busy.pop(key)], CLIENT) == [True]
        self.committed.add(key)

    @invariant()
    def every_done_runs_once_and_only_when_its_fetches_are_over(self) -> None:
        for request, calls in self.done_calls.items():
            assert calls == (0 if request in self.waiting else 1), (request, calls)

    @invariant()
    def the_pool_holds_what_the_model_says(self) -> None:
        pool = self.tenant.pool
        late = sum(len(v) for v in self.late.values())
        assert pool.statistics().reserved == len(self.inflight) + late + len(self.busy)
        for key in KEYS:
            assert pool.exists([key]) == (1 if key in self.committed else 0), key


TestFetchBookMachine = FetchBookMachine.TestCase
TestFetchBookMachine.settings = settings(max_examples=150, stateful_step_count=30,
                                         deadline=None)
