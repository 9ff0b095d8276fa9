"""Credentials for the tests' S3 endpoint; the endpoint itself is `store.s3_server.S3Server`."""

from store.s3_server import S3Server

S3_ACCESS_KEY = "kvpool-test"
S3_SECRET_KEY = "kvpool-test-secret"

__all__ = ["S3Server", "S3_ACCESS_KEY", "S3_SECRET_KEY"]
