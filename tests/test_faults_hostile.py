"""Hostile inputs, round 2 (a probe run as a hostile user would): one test per finding that is not about the cache
(tests/test_hub_faults.py) or a report (tests/test_eval_report_typed.py). Each failed on the code before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qconv.errors import QconvError


@pytest.mark.parametrize("value, says", [("1", "the string '1'; it must be the number 1"), (True, "unsupported")])
def test_schema_version_messages_say_what_is_wrong(tmp_path, value, says):
    """"schema_version '1' (this qconv reads 1)" left the reader puzzled: the string is named as a string."""
    from qconv.hub.index import index_from_dict
    from qconv.manifest import Manifest

    with pytest.raises(QconvError) as e:
        Manifest.from_dict({"schema_version": value})
    assert says in str(e.value)
    if value == "1":
        with pytest.raises(QconvError) as e:
            index_from_dict({"schema_version": value, "artifacts": []}, "idx.json")
        assert "index schema_version is the string '1'" in str(e.value)
