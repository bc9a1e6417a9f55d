"""The views of tensors the kernels read: rows with a unit last stride, and the strides of optional vectors."""

import math


def rows_view(t):
    """t (..., n) as (rows, n) with unit last stride, the layout the kernels read: a view where the
    leading dims merge and the last is contiguous, else a copy. Unlike reshape(-1, n), this also
    works for n = 0 (an empty inner dimension)."""
    return last_dim_contiguous(t.reshape(math.prod(t.shape[:-1]), t.shape[-1]))


def vector_stride(vector):
    """The element stride of an optional (n,) bias or weight (0 for None): kernels read strided and
    expanded vectors as they are."""
    return 0 if vector is None else vector.stride(0)


def last_dim_contiguous(t):
    """t itself when its last dimension has unit stride (kernels take the other strides as they are)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()
