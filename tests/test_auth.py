"""The token a request carries (auth.given_token): `Authorization: Bearer`, Deepgram's `Token`
scheme, else `?token=`; any other scheme carries none. Units on a bare ASGI scope."""

from __future__ import annotations

import pytest
from starlette.requests import HTTPConnection

from nemo_serve.server.auth import authorized, given_token


def conn(authorization: str | None = None, query: str = "") -> HTTPConnection:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    return HTTPConnection({"type": "http", "headers": headers, "query_string": query.encode()})


@pytest.mark.parametrize(
    "authorization, query, expected",
    [
        ("Bearer s3cret", "", "s3cret"),
        ("bearer  s3cret ", "", "s3cret"),
        ("Token s3cret", "", "s3cret"),  # Deepgram's SDK and plugins
        ("TOKEN s3cret", "", "s3cret"),
        ("Basic s3cret", "", ""),  # another scheme carries no token
        ("s3cret", "", ""),
        (None, "token=s3cret", "s3cret"),  # browsers
        ("Basic x", "token=s3cret", "s3cret"),
    ],
)
def test_given_token(authorization, query, expected):
    assert given_token(conn(authorization, query)) == expected


def test_authorized_takes_the_token_in_either_scheme_and_nothing_else():
    assert authorized(conn("Token s3cret"), "s3cret")
    assert authorized(conn("Bearer s3cret"), "s3cret")
    assert not authorized(conn("Token wrong"), "s3cret")
    assert not authorized(conn("Tokens3cret"), "s3cret")
    assert not authorized(conn(), "s3cret")
    assert authorized(conn(), None)  # no token configured
