"""``use_defaults`` (Django's ``ONCEFLOW = {...}``): values beneath the environment and the
arguments, which win whole — a dict setting is replaced, never merged with them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from onceflow.settings import Settings, get_settings, use_defaults
from tests.conftest import env

CODE_KEY, ENV_KEY = "a" * 64, "b" * 64


@pytest.fixture(autouse=True)
def no_defaults() -> Iterator[None]:
    yield
    use_defaults({})


def test_the_defaults_apply_where_nothing_else_sets_a_value() -> None:
    use_defaults({"lease_seconds": 41, "MAX_ATTEMPTS": 7})
    assert (get_settings().lease_seconds, get_settings().max_attempts) == (41, 7)
    with env(ONCEFLOW_LEASE_SECONDS="12"):
        assert (Settings().lease_seconds, Settings().max_attempts) == (12, 7)
    assert Settings(lease_seconds=3).lease_seconds == 3
    use_defaults({})
    assert Settings().lease_seconds == 30


def test_a_dict_setting_from_the_environment_replaces_the_defaults_one() -> None:
    use_defaults({"api_keys": {CODE_KEY: ["w1"]}})
    assert Settings().api_keys == {CODE_KEY: ["w1"]}
    with env(ONCEFLOW_API_KEYS=json.dumps({ENV_KEY: ["w2"]})):
        assert Settings().api_keys == {ENV_KEY: ["w2"]}  # not the two merged
    assert Settings(api_keys={ENV_KEY: ["w3"]}).api_keys == {ENV_KEY: ["w3"]}


def test_unknown_names_and_refused_values_change_nothing() -> None:
    use_defaults({"lease_seconds": 41})
    with pytest.raises(ValueError, match="unknown onceflow setting"):
        use_defaults({"lease_secnds": 1})
    with pytest.raises(ValueError, match="lease_seconds"):
        use_defaults({"lease_seconds": -1})
    assert Settings().lease_seconds == 41
