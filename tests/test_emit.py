"""plan --emit writes YAML by hand (a base install has no PyYAML): PyYAML must read back
exactly the mapping that was written."""

from __future__ import annotations

import math
import subprocess
import sys

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.plan.emit import dump_yaml

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False)
           | st.text(max_size=30))
keys = st.text(min_size=1, max_size=12)
documents = st.recursive(st.dictionaries(keys, scalars, max_size=4),
                         lambda inner: st.dictionaries(keys, scalars | inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(documents)
def test_pyyaml_reads_back_what_was_written(document):
    assert yaml.safe_load(dump_yaml(document) or "{}") == document


def test_the_words_yaml_would_misread_are_quoted():
    tricky = {"yes": "no", "on": "Off", "null": "~", "n": "Y", "1": "0x1F", "1:20": "1e3", "date": "2026-11-24",
              "colon": "a: b", "hash": "a #b", "trail": "ends: ", "star": "*ref", "bang": "!tag", "empty": "",
              "dash": "- x", "dot": ".inf", "braces": "{a}", "launch": "torchrun --rdzv-endpoint $MASTER_ADDR:29500"}
    assert yaml.safe_load(dump_yaml(tricky)) == tricky
    assert "launch: torchrun --rdzv-endpoint $MASTER_ADDR:29500\n" in dump_yaml(tricky)  # plain when safe


def test_floats_and_specials_keep_their_type():
    values = {"util": 0.9, "tiny": 1e-05, "big": 1e16, "inf": math.inf, "minus": -math.inf, "int": 3,
              "flag": False, "none": None, "empty": {}}
    text = dump_yaml(values)
    assert "tiny: 1.0e-05\n" in text and "util: 0.9\n" in text and "empty: {}\n" in text
    assert yaml.safe_load(text) == values


def test_emit_imports_without_pyyaml():
    blocked = ("import sys; sys.modules['yaml'] = None\n"
               "from batchfit.plan.emit import dump_yaml\n"
               "print(dump_yaml({'training': {'batch_size': 8}}), end='')")
    out = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, check=True).stdout
    assert out == "training:\n  batch_size: 8\n"
