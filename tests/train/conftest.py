import pytest

from noloco.train.config import SMOKE, load_config

TINY = list(SMOKE)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def tiny_config(data_cache, tmp_path):
    """A seconds-long run on the real default corpus, writing under tmp_path."""

    def make(*overrides: str):
        return load_config([*TINY, f"data.cache_dir={data_cache}", f"run.dir={tmp_path}", *overrides])

    return make


@pytest.fixture
def tiny_overrides(data_cache, tmp_path):
    """The tiny run's overrides as command-line arguments (for `python train.py ...` subprocesses)."""
    return [*TINY, f"data.cache_dir={data_cache}", f"run.dir={tmp_path}"]
