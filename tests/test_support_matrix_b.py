"""The support matrix (tests/support_matrix.py), half 1 of 2: no row a user can type crashes.

Fast tier: a covering array of ~80 tiny traces (split between this file and test_support_matrix.py) holding every
pair of values of two dimensions among fp32 / bf16-mixed / bf16 and no compile, but family x strategy.
Slow tier: every other pair (each family with each strategy, compile and float8 with every value; ~120 rows) but a
family beyond one of each kind (``support_matrix.COSTLY_FAMILIES``) compiled, in float8 or under a plain wrap (single,
ddp, fsdp, hsdp2, zero1, zero2): those ~60 rows are ``extended`` (``pytest -m extended``); and each family at its
defaults with reserved memory replayed (single and fsdp).
``BATCHFIT_SUPPORT_RESULTS=path.jsonl`` keeps each row's outcome (benchmarks/support_table.py
writes docs/support.md from them).
"""

from __future__ import annotations

import pytest

import support_matrix as matrix


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tmp_path_factory.mktemp("support")


@pytest.mark.parametrize("row", matrix.half(matrix.pairwise_rows(), 1), ids=matrix.row_id)
def test_every_pair_of_options_traces_or_is_refused_in_one_line(row, configs):
    matrix.check(row, configs, limit="allocated")


@pytest.mark.slow
@pytest.mark.parametrize("row", matrix.half(matrix.slow_rows(), 1), ids=matrix.row_id)
def test_every_other_pair_traces_or_is_refused_in_one_line(row, configs):
    matrix.check(row, configs, limit="allocated")


@pytest.mark.slow
@pytest.mark.parametrize("row", matrix.half(matrix.default_rows(), 1), ids=matrix.row_id)
def test_every_family_at_its_defaults_replays_its_reserved_memory(row, configs):
    matrix.check(row, configs)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("row", matrix.extended_rows(), ids=matrix.row_id)
def test_each_family_with_each_costly_value_traces_or_is_refused_in_one_line(row, configs):
    """The pairs CI's slow tier leaves out (``support_matrix.COSTLY_FAMILIES``): the other families compiled,
    in float8 and under the plain wraps."""
    matrix.check(row, configs, limit="allocated")
