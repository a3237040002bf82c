"""Reference-counted pages: who holds each page of the pools, and where a write may go.

Every session run (a slot's local branch: ``sink + window`` slots) has a *page table*: the
page that holds each of its slots (the null page for a slot never written). A session's own
pages are written in place; a page another session's table also holds (a fork shares its
source's history) is never written: the writer's slot is remapped to a fresh page first. A
page holds whole frames and a commit writes whole frames, so a remap moves no byte: the new
block goes to the fresh page, the shared one keeps what the other sessions read.

The pool has ``capacity x runs`` pages and every table at most ``sink + window`` entries, so
the distinct pages in use never exceed the pool; a remapped slot needs a page only when its
old page is still held by a table other than the writers' after the write, so a free page
always exists when one is needed. That holds for a batched write only when its rows are
planned together (:meth:`PagePool.plan_batch`): a session and its fork that overwrite the
same shared page release it together, and one of them keeps it.

Everything here is host bookkeeping (numpy), planned before the device write and applied
only after it returned (:meth:`PagePool.plan_writes`; the counts follow the session value the
state publishes, through :meth:`PagePool.exchange` alone): a failed write changes no count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["PagePool", "PagePlan"]

PageTable = tuple[int, ...]


class PagePlan:
    """Where one run's write goes: its new page table and the pages to write, planned, not applied.

    Attributes:
      old: the table before the write.
      new: the table after it (the written slots remapped where their page was shared).
      pages: the pages written, in the order of the written slots.
    """

    __slots__ = ("old", "new", "pages")

    def __init__(self, old: PageTable, new: PageTable, pages: np.ndarray) -> None:
        self.old, self.new, self.pages = old, new, pages


class PagePool:
    """Reference counts of the ``num_pages`` pages (the null page, id ``num_pages``, is never counted)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._counts = np.zeros(num_pages, np.int32)
        self._version = 0

    @property
    def null_page(self) -> int:
        return self.num_pages

    @property
    def pages_in_use(self) -> int:
        """Distinct pages some session holds: a page shared by N sessions counts once."""
        return int(np.count_nonzero(self._counts))

    @property
    def shared_pages(self) -> int:
        """Pages more than one session holds."""
        return int(np.count_nonzero(self._counts > 1))

    def count(self, page: int) -> int:
        return 0 if page == self.num_pages else int(self._counts[page])

    def empty_table(self, run_pages: int) -> PageTable:
        return (self.num_pages,) * run_pages

    def is_free(self, pages: Iterable[int]) -> bool:
        """Whether no session holds any of ``pages``."""
        index = np.asarray([p for p in pages if p != self.num_pages], np.int64)
        return not index.size or not self._counts[index].any()

    def plan_writes(self, table: PageTable, slots: Sequence[int], home: PageTable,
                    reserved: set[int] | None = None) -> PagePlan:
        """Where a write of ``slots`` of a run with ``table`` goes; ``home``: the run's own pages, preferred.

        A slot whose page only this run holds is written in place. Any other slot (never
        written, or its page shared) gets a fresh page: its home page when free, else the
        lowest free page. ``reserved`` collects the fresh pages of other plans of the same
        device write, so two plans never get one page; it is updated. (One run's write:
        :meth:`plan_batch` with one row.)
        """
        return self.plan_batch([(table, slots, home)], reserved)[0]

    def plan_batch(self, rows: Sequence[tuple[PageTable, Sequence[int], PageTable]],
                   reserved: set[int] | None = None) -> list[PagePlan]:
        """Where one device write of several runs goes (a batch: ``(table, slots, home)`` per row), planned together.

        The rows' remaps are counted together: a page every holder of which is a row of this
        write that overwrites the slot it sits in (a session and its fork writing the same
        slot) is released by all of them at once, so it stays with one of them, written in
        place, and only the others need a fresh page. Planned one row at a time, each row
        would see the page still held by the others and take a fresh page too: on a geometry
        with no sink and a 4-frame window (Matrix-Game) a session and its fork then needed
        more free pages than the pool has. The write happens after the batch's forward read
        every page, so nothing overwritten is read afterwards; what a row overwrites in place
        is the frame its own commit evicts.

        A page goes to one row at most; ``reserved`` (pages other plans of the same write
        took) is respected and updated. Counts do not change: they follow the published values.
        """
        reserved = set() if reserved is None else reserved
        released = np.zeros(self.num_pages, np.int32)  # how many rows overwrite each page's slot
        for table, slots, _ in rows:
            for slot in slots:
                if table[slot] != self.num_pages:
                    released[table[slot]] += 1
        free: list[int] | None = None
        plans = []
        for table, slots, home in rows:
            new = list(table)
            pages = np.empty(len(slots), np.int32)
            for i, slot in enumerate(slots):
                page = new[slot]
                if page != self.num_pages and self._counts[page] == released[page] and page not in reserved:
                    reserved.add(page)  # kept by this row; the other rows that held it move to fresh pages
                    pages[i] = page
                    continue
                fresh = home[slot]
                if fresh in reserved or self._counts[fresh] != 0:
                    if free is None:
                        free = [int(p) for p in np.flatnonzero(self._counts == 0)]
                    fresh = next((p for p in free if p not in reserved), None)
                    if fresh is None:  # the arithmetic in the module docstring says this cannot happen
                        raise RuntimeError("AR-Diffusion KV pages exhausted: no free page for a remapped slot")
                reserved.add(fresh)
                new[slot] = fresh
                pages[i] = fresh
            plans.append(PagePlan(tuple(table), tuple(new), pages))
        return plans

    @property
    def version(self) -> int:
        """How many times the counts changed: a check of tables against the counts holds while it stays."""
        return self._version

    def exchange(self, held: Iterable[int], dropped: Iterable[int]) -> None:
        """One more holder for each page of ``held``, one fewer for each of ``dropped``: all or nothing.

        The one method that changes a count (its one caller: the state's publish, as tables
        change). Every id is checked before any count changes, so a refused call (an id
        outside the pool, a page released more often than held) leaves every count as it was.
        """
        counts = self._counts + self._tally(held, "held") - self._tally(dropped, "released")
        if (counts < 0).any():  # pragma: no cover - every drop pairs with a hold
            raise RuntimeError(f"AR-Diffusion pages {np.flatnonzero(counts < 0).tolist()} released more often than "
                               "held")
        self._counts = counts
        self._version += 1

    def check_held(self, tables: Iterable[PageTable], what: str = "tables") -> None:
        """RuntimeError unless every page ``tables`` name (the null page aside) is a page of this pool someone holds."""
        index = np.fromiter((page for table in tables for page in table if page != self.num_pages), np.int64)
        if not index.size:
            return
        inside = (index >= 0) & (index < self.num_pages)
        held = np.zeros(index.shape, bool)
        held[inside] = self._counts[index[inside]] > 0
        if not held.all():
            raise RuntimeError(f"AR-Diffusion {what} names pages {sorted({int(p) for p in index[~held]})} the page "
                               "pool does not hold; refused before anything moved (the session's KV cannot be "
                               "trusted: release it)")

    def _tally(self, pages: Iterable[int], what: str) -> np.ndarray:
        """How often each page occurs in ``pages`` (the null page ignored); ValueError for an id outside the pool."""
        index = np.asarray([int(p) for p in pages if p != self.num_pages], np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.num_pages):
            bad = sorted({int(p) for p in index if not 0 <= p < self.num_pages})
            raise ValueError(f"AR-Diffusion pages {bad} {what} are outside the pool [0, {self.num_pages})")
        return np.bincount(index, minlength=self.num_pages).astype(np.int32)

    def checked_tables(self, tables: Any, num_runs: int, run_pages: int, what: str = "pages") -> tuple[PageTable, ...]:
        """``tables`` as tuples of ints if they are page tables of this pool, else ValueError naming ``what``.

        ``num_runs`` tables (or none: nothing written) of ``run_pages`` entries, each entry an
        integer page id in ``[0, num_pages)`` or the null page, no page in two entries (a run
        holds a page once; two runs of one session never share one).
        """
        if not isinstance(tables, (tuple, list)) or (tables and len(tables) != num_runs):
            raise ValueError(f"AR-Diffusion {what} must be {num_runs} page tables (or none), got {tables!r}")
        checked: list[PageTable] = []
        seen: set[int] = set()
        for run, table in enumerate(tables):
            if not isinstance(table, (tuple, list)) or len(table) != run_pages:
                raise ValueError(f"AR-Diffusion {what}[{run}] must be a table of {run_pages} page ids, got {table!r}")
            for slot, page in enumerate(table):
                if isinstance(page, (bool, np.bool_)) or not isinstance(page, (int, np.integer)) \
                        or not 0 <= page <= self.num_pages:
                    raise ValueError(f"AR-Diffusion {what}[{run}][{slot}] = {page!r} is not a page of this pool: "
                                     f"an integer in [0, {self.num_pages}) or the null page {self.num_pages}")
                if page != self.num_pages and int(page) in seen:
                    raise ValueError(f"AR-Diffusion {what}[{run}][{slot}]: page {int(page)} appears twice in the "
                                     "session's tables (a page holds one frame of one run)")
                seen.add(int(page))
            checked.append(tuple(int(page) for page in table))
        return tuple(checked)

    def check_tables(self, tables: Iterable[PageTable]) -> None:
        """RuntimeError unless the counts are exactly the holders among ``tables`` (a consistency check for tests)."""
        expected = np.zeros_like(self._counts)
        for table in tables:
            for page in table:
                if page != self.num_pages:
                    expected[page] += 1
        if not np.array_equal(expected, self._counts):
            raise RuntimeError("AR-Diffusion page counts disagree with the sessions' page tables")
