"""The support matrix (tests/support_matrix.py), half 0 of 2: no row a user can type crashes.

Fast tier: every pair of values of any two dimensions (a covering array, ~200 tiny traces, split
between this file and test_support_matrix_b.py). Slow tier: every family with each value of every dimension
alone (the cells of docs/support.md). ``BATCHFIT_SUPPORT_RESULTS=path.jsonl`` keeps each row's
outcome (benchmarks/support_table.py writes docs/support.md from them).
"""

from __future__ import annotations

import pytest

import support_matrix as matrix

PAIRS = matrix.half(matrix.pairwise_rows(), 0)
SINGLES = matrix.half(matrix.single_rows(), 0)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tmp_path_factory.mktemp("support")


@pytest.mark.parametrize("row", PAIRS, ids=matrix.row_id)
def test_every_pair_of_options_traces_or_is_refused_in_one_line(row, configs):
    matrix.check(row, configs, limit="allocated")


@pytest.mark.slow
@pytest.mark.parametrize("row", SINGLES, ids=matrix.row_id)
def test_every_family_with_each_option_traces_or_is_refused_in_one_line(row, configs):
    matrix.check(row, configs)


def test_the_covering_array_holds_every_allowed_pair():
    rows = matrix.pairwise_rows()
    dims = list(matrix.DIMENSIONS)
    covered = {pair for row in rows for pair in matrix._pairs(row, dims)}
    for (d1, values1), (d2, values2) in __import__("itertools").combinations(matrix.DIMENSIONS.items(), 2):
        for v1 in values1:
            for v2 in values2:
                allowed = matrix.refusal({d1: v1, d2: v2}) is None
                assert (((d1, v1), (d2, v2)) in covered) == allowed, (d1, v1, d2, v2)
    assert len(rows) < 250  # a covering array, not the product (tens of thousands of rows)


@pytest.mark.parametrize("example, why", [(e, w) for e, _, w in matrix.REFUSED], ids=lambda x: x if isinstance(x, str) else "")
def test_what_the_array_leaves_out_is_refused_in_one_line(example, why, configs):
    """The pairs the covering array leaves out are refused, in one line, as declared."""
    outcome = matrix.run_row({**matrix.DEFAULTS, "family": "llama", **example}, configs, limit="allocated")
    assert outcome.status == "refused", (why, outcome.status, outcome.detail)
    assert "\n" not in outcome.detail, outcome.detail
