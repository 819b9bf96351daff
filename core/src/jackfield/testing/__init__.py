"""Conformance kit for backend authors (a pytest plugin registered as `jackfield`)."""
