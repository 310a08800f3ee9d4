"""The support matrix (tests/support_matrix.py): no row a user can type crashes.

Fast tier: every pair of values of any two dimensions (a covering array of ~200 tiny traces).
Slow tier: every family with each value of every dimension alone (the cells of docs/support.md).
Set ``BATCHFIT_SUPPORT_RESULTS=path.jsonl`` to keep each row's outcome (benchmarks/support_table.py
writes docs/support.md from them).
"""

from __future__ import annotations

import json
import os

import pytest

import support_matrix as matrix

PAIRS = matrix.pairwise_rows()
SINGLES = matrix.single_rows()


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tmp_path_factory.mktemp("support")


def _check(row: dict, folder) -> None:
    outcome = matrix.run_row(row, folder)
    results = os.environ.get("BATCHFIT_SUPPORT_RESULTS")
    if results:
        with open(results, "a") as file:
            file.write(json.dumps(outcome.to_json()) + "\n")
    assert outcome.status != "crash", f"{matrix.row_id(row)}: {outcome.detail}"
    if outcome.status == "refused":  # one line, that says what to use instead
        assert "\n" not in outcome.detail and ":" in outcome.detail, outcome.detail


@pytest.mark.parametrize("row", PAIRS, ids=matrix.row_id)
def test_every_pair_of_options_traces_or_is_refused_in_one_line(row, configs):
    _check(row, configs)


@pytest.mark.slow
@pytest.mark.parametrize("row", SINGLES, ids=matrix.row_id)
def test_every_family_with_each_option_traces_or_is_refused_in_one_line(row, configs):
    _check(row, configs)


@pytest.mark.parametrize("example, why", [(e, w) for e, _, w in matrix.REFUSED], ids=lambda x: x if isinstance(x, str) else "")
def test_what_the_matrix_leaves_out_is_refused_in_one_line(example, why, configs):
    """The pairs the covering array leaves out are refused, in one line, as declared."""
    outcome = matrix.run_row({**matrix.DEFAULTS, "family": "llama", **example}, configs)
    assert outcome.status == "refused", (why, outcome.status, outcome.detail)
    assert "\n" not in outcome.detail, outcome.detail
