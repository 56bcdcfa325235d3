"""Options the runtime reads from a connection URL's query (`schema`, `pool_size`,
`lease_ttl`, ...), taken out before the rest goes to the driver, which would refuse them."""

from __future__ import annotations

import re
import urllib.parse

from copilot_runtime._exceptions import SECRET_KEYS, ConfigurationError

__all__ = ["checked_redis_db", "lease_ttl_option", "pool_size_option", "redacted_url",
           "schema_option", "split_options"]

#: The most connections a `pool_size` option may ask for.
_MOST_POOLED = 100


def split_options(url: str, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """`url` without the query parameters in `names`, and their values (the last one of
    each)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": an unclosed bracket
        raise ConfigurationError(f"cannot read the URL: {exc}") from None
    kept, options = [], {}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if key in names:
            options[key] = value
        else:
            kept.append((key, value))
    # Spaces written %20, as libpq decodes them (it reads `+` as a plus: `options=-c x=1`
    # would reach the server as "-c+x=1").
    query = urllib.parse.urlencode(kept, quote_via=urllib.parse.quote)
    return urllib.parse.urlunsplit(parts._replace(query=query)), options


_SECRET_KEYS = re.compile(SECRET_KEYS, re.IGNORECASE)


def redacted_url(url: str) -> str:
    """`url` with its password and the values of its secret query options (`password`,
    `sslpassword`, a `token`: the names logs redact) written `***`: for messages, banners
    and logs. Cut by hand, not by `urlsplit`: it writes `sqlite:///x` back as `sqlite:/x`,
    and refuses some broken URLs (whose password must be hidden too)."""
    scheme, slashes, rest = url.partition("://")
    prefix = ""
    if slashes:
        # The user's part ends at the last `@` before the path: a password may hold `@`, and
        # `?` or `#` too (libpq reads them so), so it is cut before the query is.
        at = rest.rfind("@", 0, rest.find("/") % (len(rest) + 1))
        if at >= 0:
            user, colon, _ = rest[:at].partition(":")
            prefix, rest = f"{scheme}://{user}{colon and ':***'}@", rest[at + 1:]
        else:
            prefix = f"{scheme}://"
    else:
        rest = url
    head, hashmark, fragment = rest.partition("#")
    base, mark, query = head.partition("?")
    base = prefix + base
    query = "&".join(
        f"{key}=***" if sep and _SECRET_KEYS.search(urllib.parse.unquote_plus(key))
        else f"{key}{sep}{value}"
        for key, sep, value in (pair.partition("=") for pair in query.split("&")))
    return f"{base}{mark}{query}{hashmark}{fragment}"


def schema_option(options: dict[str, str]) -> str | None:
    """The `schema` option, or None without one. An empty one is refused: an unset shell
    variable (`?schema=$SCHEMA`) would have shared the default schema, silently."""
    schema = options.get("schema")
    if schema == "":
        raise ConfigurationError("?schema= is empty: give it a schema name, or leave it out "
                                 "for the default")
    return schema


def pool_size_option(options: dict[str, str], default: int) -> int:
    """The `pool_size` option (the most connections a pool opens), or `default`."""
    raw = options.get("pool_size")
    if raw is None:
        return default
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if not 1 <= size <= _MOST_POOLED:
        raise ConfigurationError(
            f"pool_size must be a whole number from 1 to {_MOST_POOLED}, got {raw!r}")
    return size


def lease_ttl_option(options: dict[str, str], default: float) -> float:
    """The `lease_ttl` option (seconds a coordinator's lease outlives its renewal), or
    `default`."""
    raw = options.get("lease_ttl")
    if raw is None:
        return default
    try:
        ttl = float(raw)
    except ValueError:
        raise ConfigurationError(f"lease_ttl must be a number of seconds, got {raw!r}") from None
    if not 0.2 <= ttl <= 3600:
        raise ConfigurationError("lease_ttl must be between 0.2 and 3600 seconds")
    return ttl


def checked_redis_db(url: str) -> None:
    """Refuse a Redis URL whose path is not a database number: redis-py ignores such a path
    and uses database 0, which other deployments may share."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path).strip("/")
    if parts.scheme != "unix" and path and not (
            path.isascii() and path.isdigit() and len(path) < 6):
        raise ConfigurationError(f"a Redis URL's path is its database number, got {path!r}")
