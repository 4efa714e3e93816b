
import os
from pathlib import Path

import pytest

import macinfer  # noqa: F401  (loads OpenBLAS before mlx)

from tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _children_import_this_checkout():
    """Scripts the tests start (train_eagle.py, mlx.launch workers, ...) import this checkout's
    macinfer, as the tests themselves do, not whichever copy pip last installed (another
    worktree's, or none)."""
    root = str(Path(__file__).resolve().parents[1])
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    yield
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def _prefix_cache_dir(tmp_path_factory):
    """Keep the prefix cache's persistent tier (on in `macinfer run`) out of ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MACINFER_PREFIX_CACHE_DIR", str(tmp_path_factory.mktemp("prefix-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Build-once cache of tiny models: tiny_models('qwen2') -> Path."""
    built = {}

    def get(arch: str = "llama", **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = build_tiny_model(path, arch, **kw)
        return built[key]

    return get


_mlx_lm_models = {}


@pytest.fixture
def load(tiny_models):
    """mlx_lm.load of a tiny model, once per session: load("qwen2", seed=1) -> (model, tokenizer)."""
    import mlx_lm

    def get(arch: str = "llama", **kw):
        path = str(tiny_models(arch, **kw))
        if path not in _mlx_lm_models:
            _mlx_lm_models[path] = mlx_lm.load(path)
        return _mlx_lm_models[path]

    return get
