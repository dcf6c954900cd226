"""The training tests use the session's shared tiny-run fixtures (``tests/conftest.py``)."""
