"""`--draft auto`: which drafter a model gets, found in this order.

  1. its own MTP layers, if its checkpoint has them (macinfer.spec_decode.mtp);
  2. a draft made for it: the one macinfer ships (the embedded SmolLM2's feature draft), or an
     EAGLE-3 draft the catalog lists for it that is on disk (macinfer.spec_decode.eagle3);
  3. a smaller model on disk with the same tokenizer (identical vocabulary and special tokens) and
     at most 1/8 of its parameters: the catalog's pairing first, then anything `macinfer ls` lists;
  4. n-gram lookup alone.

A model drafter (1-3) comes with lookup (drafter.LookupDrafter: each row drafts by whichever its
measured acceptance says pays). Nothing drafts where verifying does not pay: on MLX's CPU backend
a quantised model verifies k drafts for about k times a step (docs/platform.md), so there `auto`
is off. Nothing is downloaded. A candidate that turns out bad (MTP weights its config promises but
the files lack, an EAGLE-3 draft for another model, a tokenizer that differs) is skipped with one
line on stderr; `DraftChoice.skipped` keeps those lines. Named explicitly (`--draft mtp`, a path
or a repo id), the same faults are errors.

`describe_auto` says what `auto` would pick from a model's files alone (`macinfer show`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from macinfer.errors import MacinferError
from macinfer.modelio.hub import draft_snapshot
from macinfer.modelio.loader import dequantize_by_default, read_catalog
from macinfer.modelio.model_files import read_config
from macinfer.modelio.registry import list_models
from macinfer.spec_decode.draft_model import SHIPPED_DRAFTS, tokenizer_vocab
from macinfer.spec_decode.eagle3 import is_eagle3
from macinfer.spec_decode.mtp import mtp_keys, promised_layers

# A same-tokenizer draft model has at most this share of the target's parameters.
MAX_DRAFT_SHARE = 1 / 8


@dataclass
class DraftChoice:
    """What `auto` picked, and why (the -v line, `show`, the chat panel, GET /v1/models).

    Args:
        spec: what the speculator loads: "mtp", a draft path or name, "ngram", or None for none.
        kind: "mtp", "feature" (shipped), "eagle3", "model", "ngram" or "none".
        name: the drafter as reported.
        reason: one phrase.
        skipped: one line per candidate found bad on the way.
    """

    spec: object
    kind: str
    name: str
    reason: str
    skipped: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"draft: {self.name} ({self.reason})" if self.kind != "none" else f"draft: none ({self.reason})"


def verify_pays(info) -> bool:
    """Whether verifying k drafts costs about one step here: Metal, or float weights (OpenBLAS).

    On MLX's CPU backend quantised matmul costs time in proportion to the rows (docs/platform.md).
    """
    if mx.metal.is_available():
        return True
    quant = str(getattr(info, "quantization", "") or "")
    return "bit" not in quant


def catalog_entry(info) -> dict:
    """The catalog entry of the loaded model (by catalog name, or by its repo id), or {}."""
    models = read_catalog().get("models", {})
    name = str(getattr(info, "name", "") or "")
    if name in models:
        return models[name]
    for entry in models.values():
        if str(entry.get("source", "")).lower() == name.lower():
            return entry
    return {}


# -- same tokenizer --------------------------------------------------------------------------
def _file_vocab(path: Path) -> tuple[dict, dict] | None:
    """(token -> id, special added tokens id -> text) from a tokenizer.json, or None."""
    try:
        tj = json.loads((Path(path) / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(vocab, list):  # Unigram: [piece, score] rows
        vocab = {row[0]: i for i, row in enumerate(vocab)}
    vocab = dict(vocab)
    special = {}
    for t in tj.get("added_tokens") or []:
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special[t["id"]] = t["content"]
    return vocab, special


def _target_special(tokenizer) -> dict:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}  # mlx-lm's wrapper passes it on
    return {i: str(t) for i, t in decoder.items() if getattr(t, "special", False)}


def same_tokenizer(path: Path, vocab: dict, special: dict) -> bool:
    """Whether the model at `path` has exactly this vocabulary and these special tokens (files only)."""
    found = _file_vocab(path)
    return found is not None and found[0] == vocab and found[1] == special


def draft_models_on_disk(vocab: dict, special: dict, target_params: int, here: Path | None,
                         names: list[str] = ()) -> list[Path]:
    """Model directories on disk that can draft for a target with this vocabulary and these special
    tokens: at most MAX_DRAFT_SHARE of its parameters; the catalog's `names` first, then the largest."""
    if not target_params:
        return []
    here = Path(here).resolve() if here else None
    found = []
    for m in list_models(include_catalog=False):
        if m.path is None or not m.path.is_dir() or m.path.resolve() == here or not m.num_params:
            continue
        if m.num_params > MAX_DRAFT_SHARE * target_params:
            continue
        if same_tokenizer(m.path, vocab, special):
            rank = names.index(m.catalog_name) if m.catalog_name in names else len(names)
            found.append((rank, -m.num_params, m.name, m.path))
    return [p for *_, p in sorted(found)]


# -- choosing ---------------------------------------------------------------------------------
def _note(choice_skipped: list[str], line: str) -> None:
    choice_skipped.append(line)
    print(f"note: {line}", file=sys.stderr)


def choose(model, tokenizer, info, load) -> tuple[object, DraftChoice]:
    """The drafter `auto` gives this model, and the choice as reported.

    Args:
        model, tokenizer, info: the loaded target (info: macinfer.modelio.loader.ModelInfo or
            anything with some of its attributes; missing ones count as unknown).
        load: (spec, name) -> a model drafter (macinfer.spec_decode.speculator.make_drafter); raises
            MacinferError for a bad one.

    Returns:
        (the drafter or None, DraftChoice).
    """
    skipped: list[str] = []
    name = getattr(info, "name", None) or "the model"
    if not verify_pays(info):
        return None, DraftChoice(None, "none", "none", "quantised weights without Metal: verifying k drafts "
                                 "costs about k steps here (--dequantize loads them as float)")
    path, config = getattr(info, "path", None), getattr(info, "config", None) or {}
    if path is not None and (promised_layers(config) or mtp_keys(path, config)):
        try:
            return load("mtp", "mtp"), DraftChoice("mtp", "mtp", "mtp", "the checkpoint's own MTP layers", skipped)
        except MacinferError as e:
            _note(skipped, f"{str(e)}; drafting without them")
    if SHIPPED_DRAFTS.get(name) is not None and SHIPPED_DRAFTS[name].is_dir():
        try:
            return load(name, name), DraftChoice(name, "feature", name, "the feature draft shipped for it", skipped)
        except MacinferError as e:
            _note(skipped, f"{e}; drafting without it")
    drafts = [str(d) for d in catalog_entry(info).get("drafts", [])]
    for spec in drafts:
        where = draft_snapshot(spec)
        if where is None or read_config(where) is None or not is_eagle3(where):
            continue
        try:
            return load(str(where), spec), DraftChoice(str(where), "eagle3", spec, "an EAGLE-3 draft made for it",
                                                          skipped)
        except MacinferError as e:
            _note(skipped, f"{e}; drafting without it")
    vocab, special = tokenizer_vocab(tokenizer), _target_special(tokenizer)
    for where in draft_models_on_disk(vocab, special, getattr(info, "num_params", 0) or 0, path, drafts):
        try:
            label = _label(where)
            return load(str(where), label), DraftChoice(str(where), "model", label,
                                                        "a smaller model on disk with the same tokenizer", skipped)
        except MacinferError as e:
            _note(skipped, f"{e}; drafting without it")
    return "ngram", DraftChoice("ngram", "ngram", "ngram", "no draft model found for it: n-gram lookup", skipped)


def _label(path: Path) -> str:
    """A model directory as `macinfer ls` names it: its repo id for a Hugging Face snapshot."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return Path(path).name


def describe_auto(m) -> str:
    """What `auto` would pick for a model on disk (macinfer.modelio.registry.LocalModel), from its files."""
    config = m.config or {}
    quantised = bool(m.quantization) and m.quantization != "float"
    if quantised and not mx.metal.is_available() and not dequantize_by_default(m.num_params or 0, True):
        # It loads quantised here (too large for float32): as verify_pays decides for the loaded model.
        return "none (quantised weights without Metal: verifying k drafts costs about k steps here)"
    if m.path is not None and m.path.is_dir() and (promised_layers(config) or mtp_keys(m.path, config)):
        if mtp_keys(m.path, config):
            return "mtp (the checkpoint's own MTP layers)"
        return "n-gram lookup (its config promises MTP layers but the weight files hold none)"
    names = [n for n in (m.catalog_name, m.name) if n]
    shipped = next((n for n in names if SHIPPED_DRAFTS.get(n) is not None and SHIPPED_DRAFTS[n].is_dir()), None)
    if shipped:
        return f"{shipped} (the feature draft shipped for it) with n-gram lookup"
    catalog = read_catalog().get("models", {})
    entry = next((catalog[n] for n in names if n in catalog), {})
    drafts = [str(d) for d in entry.get("drafts", [])]
    here = [d for d in drafts if draft_snapshot(d) is not None]
    if here:
        return f"{here[0]} (on disk) with n-gram lookup"
    files = _file_vocab(m.path) if m.path is not None and m.path.is_dir() else None
    if files is not None:
        found = draft_models_on_disk(*files, m.num_params or 0, m.path, drafts)
        if found:
            return f"{_label(found[0])} (a smaller model on disk with the same tokenizer) with n-gram lookup"
    if drafts:
        return (f"n-gram lookup; known drafts not downloaded: {', '.join(drafts)} "
                f"(`macinfer pull {m.catalog_name or m.name} --with-draft`)")
    return "n-gram lookup (no MTP layers, no known draft, no smaller model on disk with its tokenizer)"
