"""TEMPORARY: the unified trainer reproduces the old trainers' runs bit for bit (golden_tmp.json was written
by ``golden_tmp.py`` with attnum.training and attnum.lm.train before they were replaced)."""
import json

from golden_tmp import GOLDEN, compare, fingerprints


def test_unified_trainer_reproduces_the_old_trainers_bitwise():
    golden = json.loads(GOLDEN.read_text())
    assert compare(fingerprints(), golden) == []
