"""URLs for messages and logs without their credentials (:mod:`pipeline.adapters.urls`)."""

from __future__ import annotations

from pipeline.adapters.urls import without_userinfo


def test_the_userinfo_part_is_removed_and_the_port_kept() -> None:
    assert without_userinfo("https://pk:sk@cloud.example:443/api/otel/v1/traces") == (
        "https://cloud.example:443/api/otel/v1/traces")
    assert without_userinfo("http://svc@127.0.0.1:8081/apis?x=1#f") == (
        "http://127.0.0.1:8081/apis?x=1#f")
    assert without_userinfo("http://u:p@[::1]:8080/x") == "http://[::1]:8080/x"


def test_a_url_without_userinfo_is_unchanged() -> None:
    for url in ("http://127.0.0.1:4318/v1/traces", "https://Example.COM/a?b=c#d",
                "http://[::1]:9/"):
        assert without_userinfo(url) == url
        assert without_userinfo(url, marker="***@") == url


def test_the_marker_shows_where_the_userinfo_was() -> None:
    assert without_userinfo("http://user:key@127.0.0.1:80/v1/chat/completions",
                            marker="***@") == "http://***@127.0.0.1:80/v1/chat/completions"


def test_drop_query_drops_the_query_and_fragment_too() -> None:
    assert without_userinfo("http://dash:pw@127.0.0.1:9/base?token=t#f", drop_query=True) == (
        "http://127.0.0.1:9/base")
    assert without_userinfo("http://127.0.0.1:9/base?token=t", drop_query=True) == (
        "http://127.0.0.1:9/base")


def test_the_password_never_reaches_the_result() -> None:
    password = "s3cret-pw"
    for url in (f"http://dash:{password}@127.0.0.1:9/", f"https://u:{password}@host/p?q=1",
                f"http://u:{password}@[::1]:8080/", f"http://a@b:{password}@host:1/"):
        for marker in ("", "***@"):
            for drop_query in (False, True):
                shown = without_userinfo(url, marker=marker, drop_query=drop_query)
                assert password not in shown, (url, shown)
