"""Run one function on many hosts at once; partial success survives.

Like Fabric's ``GroupResult``: the answer maps each item to its result or to the exception it
raised, so one unreachable host does not lose the others' results. The time taken is that of
the slowest host, not the sum.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Iterable, TypeVar

T = TypeVar("T", bound=Hashable)
R = TypeVar("R")


class GroupResult(dict):
    """item → result or Exception. ``ok`` and ``failed`` split them."""

    @property
    def ok(self) -> dict:
        return {k: v for k, v in self.items() if not isinstance(v, BaseException)}

    @property
    def failed(self) -> dict:
        return {k: v for k, v in self.items() if isinstance(v, BaseException)}


def fan_out(items: Iterable[T], fn: Callable[[T], R], *, max_workers: int = 32) -> GroupResult:
    """Call ``fn(item)`` for every item in parallel threads.

    Args:
        items: hashable items (node names, targets).
        fn: the work for one item; whatever it raises (an Exception) is kept as its result.
        max_workers: threads at most.
    Returns:
        GroupResult in the order of ``items``.
    """
    items = list(items)
    out = GroupResult()
    if not items:
        return out
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [(i, pool.submit(fn, i)) for i in items]
        for item, fut in futures:
            try:
                out[item] = fut.result()
            except Exception as e:  # kept per host, by design
                out[item] = e
    return out
