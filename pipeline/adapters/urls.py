"""URLs as messages and logs may show them: without their ``user:password@`` part.

The clients of the registry, the processors' views, the model provider and the OTLP receiver
are each given a URL that may carry credentials; each names that URL in its errors and logs
through :func:`without_userinfo`, so a password never reaches a message.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def without_userinfo(url: str, *, marker: str = "", drop_query: bool = False) -> str:
    """``url`` with its ``user:password@`` part cut out, the rest (host, port, path) as given.

    ``marker`` takes the cut part's place (e.g. ``"***@"``, to show that there was one).
    ``drop_query`` also drops the query and fragment, whether or not there was a userinfo
    part: for a base URL, where a query has no business and may hold a token. Without it, a
    URL without a userinfo part is returned unchanged.
    """
    parts = urlsplit(url)
    if drop_query:
        parts = parts._replace(query="", fragment="")
    # urlsplit's own username/password split the netloc at its last "@", as here.
    _userinfo, at, host = parts.netloc.rpartition("@")
    if not at and not drop_query:
        return url
    return urlunsplit(parts._replace(netloc=marker + host if at else host))
