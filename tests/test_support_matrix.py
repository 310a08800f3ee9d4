"""The support matrix (tests/support_matrix.py), half 0 of 2: no row a user can type crashes.

Fast tier: a covering array of ~80 tiny traces (split between this file and test_support_matrix_b.py) holding every
pair of values of two dimensions among fp32 / bf16-mixed / bf16 and no compile, but family x strategy.
Slow tier: every other pair (each family with each strategy, compile and float8 with every value; ~120 rows) but a
family beyond one of each kind (``support_matrix.COSTLY_FAMILIES``) compiled, in float8 or under a plain wrap (single,
ddp, fsdp, hsdp2, zero1, zero2): those ~60 rows are ``extended`` (``pytest -m extended``); and each family at its
defaults with reserved memory replayed (single and fsdp).
``BATCHFIT_SUPPORT_RESULTS=path.jsonl`` keeps each row's outcome (benchmarks/support_table.py
writes docs/support.md from them).
"""

from __future__ import annotations

import itertools

import pytest

import support_matrix as matrix


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tmp_path_factory.mktemp("support")


@pytest.mark.parametrize("row", matrix.half(matrix.pairwise_rows(), 0), ids=matrix.row_id)
def test_every_pair_of_options_traces_or_is_refused_in_one_line(row, configs):
    matrix.check(row, configs, limit="allocated")


@pytest.mark.slow
@pytest.mark.parametrize("row", matrix.half(matrix.slow_rows(), 0), ids=matrix.row_id)
def test_every_other_pair_traces_or_is_refused_in_one_line(row, configs):
    matrix.check(row, configs, limit="allocated")


@pytest.mark.slow
@pytest.mark.parametrize("row", matrix.half(matrix.default_rows(), 0), ids=matrix.row_id)
def test_every_family_at_its_defaults_replays_its_reserved_memory(row, configs):
    matrix.check(row, configs)


def test_the_two_arrays_hold_every_allowed_pair():
    covered = matrix.all_pairs_covered()
    for (d1, values1), (d2, values2) in itertools.combinations(matrix.DIMENSIONS.items(), 2):
        for v1 in values1:
            for v2 in values2:
                allowed = matrix.refusal({d1: v1, d2: v2}) is None
                assert (((d1, v1), (d2, v2)) in covered) == allowed, (d1, v1, d2, v2)
    assert len(matrix.pairwise_rows()) + len(matrix.slow_rows()) < 400  # not the product (~10^5 rows)


@pytest.mark.parametrize("example, why", [(e, w) for e, _, w in matrix.REFUSED],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_what_the_arrays_leave_out_is_refused_in_one_line(example, why, configs):
    """The pairs the covering arrays leave out are refused, in one line, as declared."""
    outcome = matrix.run_row({**matrix.DEFAULTS, "family": "llama", **example}, configs, limit="allocated")
    assert outcome.status == "refused", (why, outcome.status, outcome.detail)
    assert "\n" not in outcome.detail, outcome.detail
