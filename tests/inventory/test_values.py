"""inventory/values.py: the planner's values and the dtypes they are sized at."""

from __future__ import annotations

import pytest

import pipemap
from pipemap.inventory.values import resolve_dtype


def test_unknown_dtype_is_typed():
    with pytest.raises(pipemap.UnknownDtypeError) as err:
        resolve_dtype("float17", None)
    assert err.value.dtype == "float17"
