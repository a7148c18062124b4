"""The pool core (plain synchronous classes, no I/O) and, in ``ems.server``, the daemon."""

from ems.pool.allocator import Allocator
from ems.pool.core import Grant, GrantStatus, Pin, Pool, PoolStatistics
from ems.pool.eviction import LruPolicy

__all__ = ["Allocator", "Grant", "GrantStatus", "LruPolicy", "Pin", "Pool", "PoolStatistics"]
