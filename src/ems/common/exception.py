"""``from ems.common.exception import EmsErrorCode, EmsException`` (original SDK path)."""

from ems.errors import EmsErrorCode, EmsException

__all__ = ["EmsErrorCode", "EmsException"]
