"""The support matrix (tests/support_matrix.py), half 1 of 2: no row a user can type crashes.

Fast tier: every pair of values of any two dimensions (a covering array, ~200 tiny traces, split
between this file and test_support_matrix.py). Slow tier: every family with each value of every dimension
alone (the cells of docs/support.md). ``BATCHFIT_SUPPORT_RESULTS=path.jsonl`` keeps each row's
outcome (benchmarks/support_table.py writes docs/support.md from them).
"""

from __future__ import annotations

import pytest

import support_matrix as matrix

PAIRS = matrix.half(matrix.pairwise_rows(), 1)
SINGLES = matrix.half(matrix.single_rows(), 1)


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
