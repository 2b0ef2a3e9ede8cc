"""The machine's cache of batch 1's timed step choice (dejavu_trt.runtime.choice_cache), without a GPU."""
from __future__ import annotations

import json

import pytest

from dejavu_trt.runtime import choice_cache

NAMES = ["none", "mlp", "none+slack2", "mlp+slack2"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "choice.json"
    monkeypatch.setenv(choice_cache.ENV, str(path))
    return path


def test_store_then_lookup(cache):
    key = choice_cache.choice_key({"dims": [5120, 20480], "kept": [5120] * 40})
    assert choice_cache.lookup(key, NAMES) is None
    choice_cache.store(key, {"chosen": "mlp+slack2", "ms_per_step": {"none": 2.85, "mlp+slack2": 2.75}})
    got = choice_cache.lookup(key, NAMES)
    assert got["chosen"] == "mlp+slack2" and got["ms_per_step"]["none"] == 2.85
    assert [p.name for p in cache.parent.iterdir()] == ["choice.json"]  # atomic: no temporary left behind
    # an executor that cannot build the cached candidate (no slack variants here) times afresh
    assert choice_cache.lookup(key, ["none", "mlp"]) is None


def test_key_follows_fields_and_environment(monkeypatch):
    a = choice_cache.choice_key({"kept": [1, 2]})
    assert a == choice_cache.choice_key({"kept": [1, 2]})
    assert a != choice_cache.choice_key({"kept": [1, 3]})
    monkeypatch.setenv("DJV_MLP_SLACK", "2")  # a kernel knob changes what the candidates measure
    b = choice_cache.choice_key({"kept": [1, 2]})
    assert b != a
    monkeypatch.setenv("DEJAVU_TRT_CACHE", "/elsewhere")  # where caches live does not
    monkeypatch.setenv(choice_cache.ENV, "/other/file.json")
    assert choice_cache.choice_key({"kept": [1, 2]}) == b


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99, "entries": {}}), json.dumps([1, 2])])
def test_unreadable_cache_is_reported_and_replaced(cache, content):
    cache.parent.mkdir(parents=True)
    cache.write_text(content)
    key = choice_cache.choice_key({"x": 1})
    with pytest.warns(UserWarning, match="timing afresh"):
        assert choice_cache.lookup(key, NAMES) is None
    with pytest.warns(UserWarning, match="replaced"):
        choice_cache.store(key, {"chosen": "none", "ms_per_step": {"none": 1.0}})
    assert choice_cache.lookup(key, NAMES)["chosen"] == "none"


def test_disabled_by_zero(tmp_path, monkeypatch):
    monkeypatch.setenv(choice_cache.ENV, "0")
    monkeypatch.chdir(tmp_path)
    assert choice_cache.cache_path() is None
    choice_cache.store("k", {"chosen": "none", "ms_per_step": {"none": 1.0}})
    assert choice_cache.lookup("k", NAMES) is None
    assert list(tmp_path.iterdir()) == []


def test_default_path_is_the_project_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(choice_cache.ENV, raising=False)
    monkeypatch.setenv("DEJAVU_TRT_CACHE", str(tmp_path))
    assert choice_cache.cache_path() == tmp_path / "step_choice.json"


def test_keeps_the_newest_entries(cache, monkeypatch):
    monkeypatch.setattr(choice_cache, "MAX_ENTRIES", 3)
    clock = iter(range(100))
    monkeypatch.setattr(choice_cache.time, "time", lambda: float(next(clock)))
    for i in range(5):
        choice_cache.store(f"k{i}", {"chosen": "none", "ms_per_step": {"none": float(i)}})
    kept = json.loads(cache.read_text())["entries"]
    assert sorted(kept) == ["k2", "k3", "k4"]


def test_a_malformed_entry_is_a_miss(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"format": 1, "entries": {"k": {"chosen": "mlp"}, "j": "x"}}))
    assert choice_cache.lookup("k", NAMES) is None  # no timings
    assert choice_cache.lookup("j", NAMES) is None
