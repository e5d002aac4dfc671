"""A database URL in a message never carries its password, however it is spelled."""

from __future__ import annotations

import pytest
from sqlalchemy import make_url

from onceflow.db import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://u:s3cret@h:5432/db", "postgresql+psycopg://u@h:5432/db"),
        ("postgresql://u@h/db?password=s3cret", "postgresql://u@h/db"),
        ("host=db password=s3cret dbname=x", "<not a URL>"),
        ("mysql://root:s3cret@h/db", "mysql://root@h/db"),
    ],
)
def test_a_password_is_never_shown(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)


def test_a_parsed_url_loses_its_password_and_password_query() -> None:
    url = make_url("postgresql+psycopg://u:s3cret@h/db?password=s3cret&sslmode=require")
    assert redact_url(url) == "postgresql+psycopg://u@h/db?sslmode=require"
