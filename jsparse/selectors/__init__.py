"""Token selectors of the JSSA paper behind one interface (see ``base.py`` and README.md).

Names: ``jssa``, ``jssa_rd``, ``loki``, ``fasa``, ``kq_svd``, ``quest``, ``oracle``,
``head_shared``, ``full``, and ``jssa_mla`` for multi-head latent attention.
"""

from jsparse.selectors import (
    fasa,
    full,
    head_shared,
    jssa,
    jssa_mla,
    jssa_rd,
    kq_svd,
    loki,
    oracle,
    quest,
)
from jsparse.selectors.base import (
    CACHE_DTYPES,
    DEFAULT_SELECTOR,
    SELECTORS,
    ProjectedKeys,
    ProjectedSelector,
    Selector,
    make_selector,
    top_budget,
)

__all__ = [
    "CACHE_DTYPES",
    "DEFAULT_SELECTOR",
    "SELECTORS",
    "ProjectedKeys",
    "ProjectedSelector",
    "Selector",
    "fasa",
    "full",
    "head_shared",
    "jssa",
    "jssa_mla",
    "jssa_rd",
    "kq_svd",
    "loki",
    "make_selector",
    "oracle",
    "quest",
    "top_budget",
]
