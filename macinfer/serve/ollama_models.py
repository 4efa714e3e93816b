"""Ollama's API, the models: `GET /api/tags`, `POST /api/show`, `GET /api/ps`, `GET /api/version`,
`POST /api/pull`, `DELETE /api/delete`, and `GET` / `HEAD /` (its clients' liveness check);
`/api/embed` and the others macinfer does not do answer 501.

- Names: a model is listed as Ollama lists one, `NAME:latest` when its name has no tag, and a
  request may name it either way (`resolve`).
- What a model is (family, parameters, quantisation, size, context) comes from the loaded model,
  or without loading it from macinfer's registry (what `macinfer ls` / `show` read).
- `/api/pull` is macinfer's own pull (catalog names, Hugging Face repo ids) into the Hugging Face
  cache, its progress streamed as NDJSON (bytes on disk so far); `/api/delete` is `macinfer rm`
  (a loaded model is unloaded first; the default model, which stays loaded, is refused).
- `keep_alive` (`KeepAlive`): a model is unloaded once idle that long after its last Ollama reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
from datetime import datetime, timezone
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator

from macinfer import __version__
from macinfer.chat.reasoning import thinking_of
from macinfer.errors import MacinferError
from macinfer.modelio.gguf import REPORT as GGUF_REPORT
from macinfer.modelio.loader import REPO_ID
from macinfer.modelio.model_files import fmt_params
from macinfer.modelio.registry import find_model, hf_hub_cache, read_catalog
from macinfer.modelio.removal import plan_removal
from macinfer.serve.model_pool import POLL_SECONDS, ModelPool, ServedModel
from macinfer.serve.schemas import APIError

# The version of Ollama's API whose fields this server follows (clients gate features on it).
OLLAMA_VERSION = "0.12.0"
LATEST = ":latest"
PULL_POLL_SECONDS = 0.5
DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
KEEP_FOREVER_SECONDS = 100 * 365 * 86400  # a keep_alive this long keeps the model loaded
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


# -- names and durations -------------------------------------------------------------------------
def ollama_name(name: str) -> str:
    return name if ":" in name else name + LATEST


async def resolve(pool: ModelPool, name: str) -> str:
    """The served name an Ollama client's `name` or `name:latest` means.

    Raises:
        APIError: 404 naming the model, as Ollama says it ("model 'x' not found").
    """
    for candidate in (name, name[: -len(LATEST)] if name.endswith(LATEST) else None):
        if candidate:
            try:
                return (await pool.lookup(candidate)).name
            except APIError:
                pass
    raise APIError(404, f"model '{name}' not found: GET /api/tags lists the models this server serves", "model",
                   "model_not_found")


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m", "0");
    None (absent, negative, or a century or more): keep the model loaded.

    Raises:
        APIError: 400 for anything else.
    """
    if value is None or value == "":
        return None
    bad = APIError(400, f"keep_alive must be seconds or a duration such as 5m or 1h, got {value!r}",
                   "keep_alive", "invalid_value")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise bad from None
            seconds = sum(float(n) * UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise bad
    # NOTE: a century or more (inf included) is kept as a negative one is: its expiry is no date (/api/ps)
    return None if seconds < 0 or seconds >= KEEP_FOREVER_SECONDS else seconds


class KeepAlive:
    """Unloads a model once it has been idle `seconds` after its last Ollama reply (never the default)."""

    def __init__(self, pool: ModelPool):
        self.pool = pool
        self.expires: dict[str, float] = {}  # model name -> wall-clock time it will be unloaded
        self._timers: dict[str, asyncio.Task] = {}

    def cancel(self, name: str) -> None:
        """Drop `name`'s pending unload: an Ollama request for it has begun (its keep_alive comes next)."""
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()
        self.expires.pop(name, None)

    def set(self, m: ServedModel, seconds: float | None) -> None:
        self.cancel(m.name)
        if seconds is None or m.pinned:
            return
        self.expires[m.name] = time.time() + seconds
        self._timers[m.name] = asyncio.ensure_future(self._expire(m, seconds))

    async def _expire(self, m: ServedModel, seconds: float) -> None:
        # NOTE: the timer stays in _timers until the model is gone, so that an Ollama request beginning
        # meanwhile cancels it, even while the unload waits for another model's load to finish.
        try:
            await asyncio.sleep(seconds)
            while m.busy:  # another protocol's request came meanwhile: unload after it
                await asyncio.sleep(POLL_SECONDS)
            await self.pool.unload(m)
        finally:
            if self._timers.get(m.name) is asyncio.current_task():
                del self._timers[m.name]
                self.expires.pop(m.name, None)

    def shutdown(self) -> None:
        for timer in self._timers.values():
            timer.cancel()


# -- what a model is --------------------------------------------------------------------------------
def describe(m: ServedModel) -> dict:
    """{family, parameters, quantization, size, context, path, modified} of a model (loaded or not)."""
    if m.llm is not None:
        info = m.llm.info
        d = {"family": info.model_type, "parameters": info.num_params, "quantization": info.quantization,
             "size": m.nbytes or info.weight_bytes, "context": info.context_length, "path": info.path,
             "gguf": _from_gguf(info.path)}
    else:  # from the disk, without loading it
        try:
            lm = find_model(m.spec)
        except MacinferError:
            lm = None
        d = {"family": lm and lm.architecture, "parameters": lm and lm.num_params,
             "quantization": lm and lm.quantization, "size": lm and lm.size_bytes,
             "context": m.context_length or (lm and lm.context_length), "path": lm and lm.path,
             "gguf": _from_gguf(lm and lm.path)}
    path = Path(d["path"]) if d["path"] else None
    d["modified"] = path.stat().st_mtime if path is not None and path.exists() else time.time()
    return d


def _from_gguf(path) -> bool:
    """A .gguf file, or macinfer's conversion of one (its directory holds the conversion's report)."""
    return path is not None and (str(path).endswith(".gguf") or (Path(path) / GGUF_REPORT).is_file())


def details(d: dict) -> dict:
    return {"parent_model": "", "format": "gguf" if d["gguf"] else "safetensors", "family": d["family"] or "",
            "families": [d["family"]] if d["family"] else None, "parameter_size": fmt_params(d["parameters"]),
            "quantization_level": d["quantization"] or ""}


def digest(name: str, d: dict) -> str:
    """A stable id for the model (Ollama's is its manifest's sha256; macinfer has no manifests)."""
    return hashlib.sha256(f"{name}\0{d['path']}".encode()).hexdigest()


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def capabilities(m: ServedModel) -> list[str]:
    """completion; tools (any model calls them here, in its own syntax or the generic format);
    thinking when the loaded model thinks; vision when it takes images (Ollama's clients offer an
    image upload by it)."""
    thinks = m.llm is not None and thinking_of(m.llm.tokenizer) is not None
    sees = m.llm is not None and m.llm.images is not None
    return ["completion", "tools"] + (["thinking"] if thinks else []) + (["vision"] if sees else [])


def template(m: ServedModel) -> str:
    t = getattr(m.llm.tokenizer, "chat_template", None) if m.llm is not None else None
    return t if isinstance(t, str) else ""


# -- the routes ---------------------------------------------------------------------------------
class ModelRequest(BaseModel):
    """{"model": ...}; older clients send {"name": ...}."""

    model_config = ConfigDict(extra="allow")

    model: str

    @model_validator(mode="before")
    @classmethod
    def _name(cls, data):
        if isinstance(data, dict) and "model" not in data and "name" in data:
            return {**data, "model": data["name"]}
        return data


class PullRequest(ModelRequest):
    stream: bool = True
    insecure: bool | None = None


class OllamaModels:
    def __init__(self, server, keep_alive: KeepAlive):
        self.server, self.pool, self.keep_alive = server, server.pool, keep_alive

    async def tags(self) -> dict:
        out = []
        for m in await self.pool.listing():
            d = await asyncio.to_thread(describe, m)
            out.append({"name": ollama_name(m.name), "model": ollama_name(m.name), "modified_at": iso(d["modified"]),
                        "size": d["size"] or 0, "digest": digest(m.name, d), "details": details(d)})
        return {"models": out}

    async def show(self, req: ModelRequest) -> dict:
        m = await self.pool.lookup(await resolve(self.pool, req.model))
        d = await asyncio.to_thread(describe, m)
        arch = d["family"] or "unknown"
        info = {"general.architecture": arch, "general.basename": m.name, "general.parameter_count": d["parameters"],
                f"{arch}.context_length": d["context"]}
        return {"modelfile": f"# served by macinfer {__version__}\nFROM {d['path'] or m.name}\n", "parameters": "",
                "template": template(m), "details": details(d), "model_info": info,
                "capabilities": capabilities(m), "modified_at": iso(d["modified"])}

    async def ps(self) -> dict:
        out = []
        for m in self.pool.loaded():
            d = describe(m)
            expires = self.keep_alive.expires.get(m.name)
            out.append({"name": ollama_name(m.name), "model": ollama_name(m.name), "size": d["size"] or 0,
                        "digest": digest(m.name, d), "details": details(d),
                        "expires_at": iso(expires) if expires is not None else None,  # None: stays loaded
                        "size_vram": d["size"] or 0, "context_length": d["context"]})
        return {"models": out}

    async def pull(self, req: PullRequest):
        """macinfer's pull; streamed: {"status"} lines, bytes on disk as `completed`, then "success"."""
        spec = req.model[: -len(LATEST)] if req.model.endswith(LATEST) else req.model
        task = asyncio.ensure_future(asyncio.to_thread(_pull, spec))
        if not req.stream:
            try:
                await task
            except MacinferError as e:
                raise APIError(400, str(e), "model", "pull_failed") from None
            return {"status": "success"}
        return StreamingResponse(self._progress(spec, task), media_type="application/x-ndjson")

    async def _progress(self, spec: str, task: asyncio.Future):
        yield json.dumps({"status": "pulling manifest"}) + "\n"
        where = await asyncio.to_thread(_download_dir, spec)
        while not task.done():
            await asyncio.wait({task}, timeout=PULL_POLL_SECONDS)
            if not task.done() and where is not None:
                done = await asyncio.to_thread(_bytes_under, where)
                yield json.dumps({"status": f"pulling {spec}", "digest": spec, "completed": done}) + "\n"
        try:
            task.result()
        except MacinferError as e:
            yield json.dumps({"error": str(e)}) + "\n"  # Ollama's error line once the stream has begun
            return
        yield json.dumps({"status": "success"}) + "\n"

    async def delete(self, req: ModelRequest):
        """`macinfer rm`: a loaded model is unloaded first (never the default, which stays loaded); one
        being loaded is let finish loading (the request that asked for it is served), then unloaded."""
        name = req.model[: -len(LATEST)] if req.model.endswith(LATEST) else req.model
        m = self.pool.find(name)
        if m is not None and m.pinned:
            raise APIError(400, f"'{name}' is this server's default model, which stays loaded: stop the server to "
                                "remove it", "model")
        while m is not None and m.loading is not None:  # its files are being read: not removed under the load
            try:
                await asyncio.shield(m.loading)
            except APIError:  # the load failed: its requests have their 503, the files can go
                pass
        if m is not None and m.loaded:
            await self.pool.unload(m)
        try:
            await asyncio.to_thread(_remove, m.spec if m is not None and m.spec else name)
        except MacinferError as e:
            missing = str(e).startswith("no model") or "not downloaded" in str(e)
            raise APIError(404 if missing else 400, str(e), "model") from None
        await self.pool.listing()  # the pool forgets it: a request naming it would download it again
        return JSONResponse(None, status_code=200)


def _pull(spec: str) -> None:
    from macinfer.modelio.hub import pull  # huggingface_hub: loaded only to pull

    pull(spec, progress=False)


def _remove(spec: str) -> None:
    plan_removal(spec).execute()


def _download_dir(spec: str) -> Path | None:
    """Where a pull of `spec` writes in the Hugging Face cache (None: not a repo it can name)."""
    entry = read_catalog().get("models", {}).get(spec) or {}
    repo = entry.get("source", spec)
    return hf_hub_cache() / ("models--" + repo.replace("/", "--")) if REPO_ID.match(repo) else None


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) if path.is_dir() else 0


NOT_SERVED = {
    "/api/embed": "embeddings are not served: macinfer runs generative models only",
    "/api/embeddings": "embeddings are not served: macinfer runs generative models only",
    "/api/create": "creating models from a Modelfile is not supported: use `macinfer quantize` or a model directory",
    "/api/copy": "copying models is not supported: serve it under another name with --served-model-name",
    "/api/push": "pushing models is not supported",
}


def add_routes(app: FastAPI, server, keep_alive: KeepAlive) -> None:
    """The Ollama model routes; those macinfer does not do answer 501 with a reason."""
    models = OllamaModels(server, keep_alive)
    app.get("/api/tags")(models.tags)
    app.get("/api/ps")(models.ps)

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION, "macinfer": __version__}

    @app.api_route("/", methods=["GET", "HEAD"])
    async def index():  # the liveness check of Ollama's CLI and clients (HEAD /), and its text
        return PlainTextResponse("Ollama is running")

    @app.post("/api/show")
    async def show(body: ModelRequest):
        return await models.show(body)

    @app.post("/api/pull")
    async def pull(body: PullRequest):
        return await models.pull(body)

    @app.delete("/api/delete")
    async def delete(body: ModelRequest):
        return await models.delete(body)

    for path, why in NOT_SERVED.items():
        app.post(path)(_not_served(why))


def _not_served(why: str):
    async def route():
        raise APIError(501, why, None, "not_implemented")
    return route
