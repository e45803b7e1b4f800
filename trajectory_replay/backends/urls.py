"""Store locations as written: a path or URL's protocol, what makes one name no store at all, and the same URL
without its credentials for anything written or printed."""

from __future__ import annotations

import os
import re


def split_url(path_or_url: str) -> tuple[str, str]:
    """(protocol, path) of a path or URL; plain paths and file:// are `file`, s3a:// is `s3`."""
    text = os.fspath(path_or_url)
    if "://" not in text:
        return "file", text
    protocol, rest = text.split("://", 1)
    protocol = protocol.lower()
    if protocol in ("s3a", "s3n"):
        protocol = "s3"
    if protocol in ("file", "local"):
        return "file", rest
    return protocol, rest


S3_BUCKET_RULE = (
    "3-63 characters: lowercase letters, digits, dots and hyphens, beginning and ending with a letter or digit"
)
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SLASHLESS_URL = re.compile(r"(s3|s3a|s3n|file|local|memory):(?!//)", re.IGNORECASE)


def location_problem(path_or_url: str | os.PathLike) -> str | None:
    """What makes `path_or_url` name no store at all, as written and before any request (an empty path, a URL
    missing its //, an unknown protocol, an S3 URL without a valid bucket name), one line naming it and what to
    write instead; None when it can name one."""
    text = os.fspath(path_or_url)
    if not text.strip():
        return "empty path: give a directory or a URL such as s3://bucket/prefix"
    slashless = _SLASHLESS_URL.match(text)
    if slashless:  # `s3:/bucket/x` would be a local directory named `s3:`
        return f"{redact_url(text)}: not a URL (no // after {slashless.group(1)}:): write {slashless.group(1)}://..."
    protocol, rest = split_url(text)
    if protocol not in ("file", "memory", "s3"):
        return unsupported_protocol(text, protocol)
    if protocol == "s3":
        return s3_bucket_problem(text, rest)
    return None


def unsupported_protocol(url: str, protocol: str) -> str:
    return f"{redact_url(url)}: unsupported storage protocol {protocol!r} (use a path, file://, s3:// or memory://)"


def s3_bucket_problem(url: str, rest: str) -> str | None:
    """What is wrong with an S3 URL (`rest`: its text after s3://) as written: credentials in it (never handed on:
    the client would echo them inside its own bucket-name error), no bucket, an invalid bucket name."""
    if _userinfo_end(rest):
        return (
            f"{redact_url(url)}: credentials in an S3 URL are not used; give them through AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, an AWS profile, or the key and secret storage options"
        )
    bucket = rest.split("/", 1)[0]
    if not bucket:
        return f"{redact_url(url)}: no bucket name: an S3 URL is s3://BUCKET/PREFIX"
    if not _S3_BUCKET.fullmatch(bucket):
        return f"{redact_url(url)}: invalid S3 bucket name {bucket!r}: a bucket name is {S3_BUCKET_RULE}"
    return None


def _userinfo_end(rest: str) -> int:
    """Where the `user:password@` part of a URL's text after `://` ends (0 when there is none). A secret key may
    hold '/' and '+' unencoded (AWS secret keys do), so an '@' after a '/' still ends it when the text before that
    '@' has the ':' between user and password; a redaction errs on the side of hiding."""
    authority = rest.split("/", 1)[0]
    if "@" in authority:
        return authority.rindex("@") + 1
    head, at, _ = rest.partition("@")
    return len(head) + 1 if at and ":" in head else 0


def redact_url(url: str) -> str:
    """`url` without user:password@ credentials (whatever they hold: '/', '+', '%2F'), for anything that is
    written or printed."""
    if "://" not in url:
        return url
    protocol, rest = url.split("://", 1)
    return f"{protocol}://{rest[_userinfo_end(rest) :]}"


__all__ = ["S3_BUCKET_RULE", "location_problem", "redact_url", "s3_bucket_problem", "split_url", "unsupported_protocol"]
