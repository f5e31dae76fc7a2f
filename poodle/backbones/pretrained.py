"""Pretrained weights of ``timm:`` and ``torchvision:`` backbones, found the way those libraries ship them.

:func:`resolve_pretrained` turns a backbone name and a choice of weights into a file, which then
loads exactly as a ``checkpoint`` of that file does (:func:`poodle.backbones.load_checkpoint`):

- ``timm:NAME[.TAG]``: the weights timm's pretrained configuration names for that tag (its default
  tag without one), located by timm's own rule (Hugging Face hub repository and file, else a URL)
  and fetched through huggingface_hub's cache (``HF_HOME`` / ``HF_HUB_CACHE``; with
  ``HF_HUB_OFFLINE=1`` only what is cached is used) or torch hub's;
- ``torchvision:NAME``: the builder's default weights enum (``ResNet50_Weights.DEFAULT``) or the
  member named, fetched through torch hub's cache (``TORCH_HOME``).

A file already in its cache is used without any network access; a missing one is downloaded into
the cache (a temporary name renamed when complete) unless downloads are off or impossible, which is
one :class:`ConfigError` naming the model, the file looked for and where to put it. The cache paths
are read from the environment at each call, so they follow ``HF_HOME`` / ``TORCH_HOME`` as set then.

:attr:`Weights.origin` is what a feature cache records about the weights besides their sha256: the
hub repository, revision and file, or the weights enum and its URL.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch.hub
import torchvision

from poodle import defaults
from poodle.backbones.external import import_timm, is_external, split_name, unknown_model
from poodle.errors import ConfigError, mark

# How ``pretrained`` names the default weights (True means the same).
DEFAULT = defaults.PRETRAINED
_TRUE = ("1", "on", "yes", "true")


@dataclass(frozen=True)
class Weights:
    """A weights file found in a library's cache, and where it came from (``origin``: attribute
    name -> text, recorded in the feature cache)."""

    path: Path
    origin: dict[str, str] = field(default_factory=dict)


def resolve_pretrained(backbone: str, choice: bool | str = True) -> Weights:
    """The weights file of ``choice`` (True or ``"DEFAULT"``: the default weights; for torchvision also
    the name of a member of the builder's weights enum) for external backbone ``backbone``.

    Raises ConfigError (``params``: ``pretrained``) for a backbone or choice without weights, and when
    the file is neither cached nor downloadable."""
    if not is_external(backbone):
        raise ConfigError(
            f"{mark('pretrained')} is for timm:NAME and torchvision:NAME backbones, not {backbone}",
            hint=f"its weights come from a {mark('checkpoint')}, e.g. of a poodle train run",
            param="pretrained",
            value=choice,
        )
    source, model = split_name(backbone)
    if source == "timm":
        if choice not in (True, DEFAULT):
            raise ConfigError(
                f"{mark('pretrained')} {choice!r}: a timm model's weights are chosen by the tag in its name",
                hint=f"timm:NAME.TAG, e.g. timm:resnet50.a1_in1k, with {mark('pretrained')} alone",
                param="pretrained",
                value=choice,
            )
        return _timm_weights(model)
    return _torchvision_weights(model, DEFAULT if choice is True else str(choice))


# ------------------------------------------------------------------------------------------ timm


def _timm_source(cfg: dict[str, Any]) -> tuple[str, Any]:
    """``(load_from, location)`` by timm's own rule (``hf-hub``, ``url``, ``file``; "" for none)."""
    try:
        from timm.models._builder import _resolve_pretrained_source  # timm's rule, private: checked below
    except ImportError:  # a timm that moved it: the same rule, without timm's legacy-cache switch
        if cfg.get("file"):
            return "file", cfg["file"]
        if cfg.get("hf_hub_id"):
            hub = cfg["hf_hub_id"]
            return "hf-hub", (hub, cfg["hf_hub_filename"]) if cfg.get("hf_hub_filename") else hub
        return ("url", cfg["url"]) if cfg.get("url") else ("", None)
    return _resolve_pretrained_source(cfg)


def _timm_weights(model: str) -> Weights:
    timm = import_timm()
    cfg = timm.get_pretrained_cfg(model)
    if cfg is None or not timm.is_model(model):
        raise unknown_model("timm", model, timm.list_models())
    full = f"{cfg.architecture}.{cfg.tag}" if getattr(cfg, "tag", None) else str(cfg.architecture)
    load_from, loc = _timm_source(cfg.to_dict())
    name = f"timm:{full}"
    origin = {"weights": name}
    if load_from == "hf-hub":
        repo, filename = loc if isinstance(loc, (tuple, list)) else (loc, None)
        return _hub_file(name, str(repo), filename, origin)
    if load_from == "url":
        return _url_file(name, str(loc), {**origin, "weights_source": "url"})
    if load_from == "file":
        path = Path(str(loc)).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{name}: timm's configuration names the weights file {path}, which does not exist",
                params=("pretrained",),
                param="backbone",
                value=name,
            )
        return Weights(path, {**origin, "weights_source": "file", "weights_file": str(path)})
    raise ConfigError(
        f"{name}: timm's configuration names no weights for it, so {mark('pretrained')} has nothing to load",
        hint=f"give a {mark('checkpoint')} FILE",
        param="backbone",
        value=name,
    )


def hf_cache_dir() -> Path:
    """huggingface_hub's cache of repositories as the environment sets it now (``HF_HUB_CACHE``, else
    ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``; huggingface_hub reads them at import only)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _hub_candidates(filename: str | None) -> list[str]:
    """The files timm would read from a repository, preferred first (timm's ``load_state_dict_from_hf``:
    the safetensors alternative of ``pytorch_model.bin`` when safetensors is installed)."""
    if filename is not None:
        if filename.endswith(".bin") and _has_safetensors():
            safe = "model.safetensors" if filename == "pytorch_model.bin" else filename[:-4] + ".safetensors"
            return [safe, filename]
        return [filename]
    return (["model.safetensors"] if _has_safetensors() else []) + ["pytorch_model.bin"]


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401 - optional: only .safetensors files need it
    except ImportError:
        return False
    return True


def _hub_file(name: str, hub_id: str, filename: str | None, origin: dict[str, str]) -> Weights:
    """The first of the repository's candidate files that is cached, else downloaded into the cache."""
    import huggingface_hub  # comes with timm; imported only for a timm backbone
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    repo, _, revision = hub_id.partition("@")
    cache = hf_cache_dir()
    files = _hub_candidates(filename)

    def fetch(file: str, local_only: bool) -> Weights:
        got = huggingface_hub.hf_hub_download(
            repo, file, revision=revision or None, cache_dir=cache, local_files_only=local_only
        )
        path = Path(str(got))
        parts = path.parts
        commit = parts[parts.index("snapshots") + 1] if "snapshots" in parts else (revision or "")
        return Weights(
            path,
            {
                **origin,
                "weights_source": "hf-hub",
                "weights_repository": repo,
                "weights_revision": commit,
                "weights_file": file,
            },
        )

    for file in files:
        try:
            return fetch(file, local_only=True)
        except LocalEntryNotFoundError:
            continue
    reason = "downloads are off (HF_HUB_OFFLINE)"
    if not _hub_offline():
        for file in files:
            try:
                return fetch(file, local_only=False)
            except LocalEntryNotFoundError as e:  # no connection: huggingface_hub says so this way
                reason = f"it cannot be downloaded ({_first_line(e)})"
                break
            except EntryNotFoundError:
                continue  # not in the repository: timm tries its next file too
            except Exception as e:  # noqa: BLE001 - network, authentication, gated repositories: one line
                reason = f"it cannot be downloaded ({type(e).__name__}: {_first_line(e)})"
                break
        else:
            reason = "the repository holds none of them"
    wanted = " or ".join(files)
    raise ConfigError(
        f"{name} with {mark('pretrained')}: {wanted} of Hugging Face repository {repo} is not in the hub cache {cache} "
        f"(HF_HOME) and {reason}",
        hint=f"where there is network, `hf download {repo} {files[0]}` with the same HF_HOME puts it there, "
        f"then copy that folder; or give a {mark('checkpoint')} FILE",
        param="backbone",
        value=name,
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:160]


# ------------------------------------------------------------------------------------------ torch hub


def torch_hub_checkpoints() -> Path:
    """torch hub's folder of weight files, as the environment sets it now (``TORCH_HOME``/hub/checkpoints)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def _url_file(name: str, url: str, origin: dict[str, str], choice: str = "") -> Weights:
    """The file of ``url`` in torch hub's cache, downloaded there (checked against the hash prefix in
    its name, as torch hub does) when missing."""
    filename = os.path.basename(urlparse(url).path)
    folder = torch_hub_checkpoints()
    path = folder / filename
    origin = {**origin, "weights_url": url, "weights_file": filename}
    if path.is_file():
        return Weights(path, origin)
    m = torch.hub.HASH_REGEX.search(filename)
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # writes a temporary file beside the target and renames it when complete
        torch.hub.download_url_to_file(url, str(path), m.group(1) if m else None, progress=False)
    except Exception as e:  # noqa: BLE001 - URLError, HTTPError, timeouts, a hash mismatch: one line
        for p in made:  # leave the cache as it was: no empty folders of a failed download
            with contextlib.suppress(OSError):
                p.rmdir()
        raise ConfigError(
            f"{name} with {mark('pretrained')}{choice}: {filename} is not in torch hub's cache {folder} (TORCH_HOME) "
            f"and cannot be downloaded from {url} ({type(e).__name__}: {_first_line(e)})",
            hint=f"put the file there, or give a {mark('checkpoint')} FILE",
            param="backbone",
            value=name,
        ) from None
    return Weights(path, origin)


# ------------------------------------------------------------------------------------------ torchvision


def _torchvision_weights(model: str, choice: str) -> Weights:
    from poodle.backbones.external import _builder  # the one check that torchvision has the model

    _builder(model)
    try:
        enum = torchvision.models.get_model_weights(model)
    except (ValueError, KeyError):
        raise ConfigError(
            f"torchvision:{model} has no weights enum, so {mark('pretrained')} has nothing to load",
            hint=f"give a {mark('checkpoint')} FILE",
            param="backbone",
            value=f"torchvision:{model}",
        ) from None
    member = choice.rpartition(".")[2]  # "ResNet50_Weights.IMAGENET1K_V2" or "IMAGENET1K_V2"
    try:
        weights = enum[member]
    except KeyError:
        names = ", ".join(w.name for w in enum)
        raise ConfigError(
            f"{mark('pretrained')} {choice!r}: {enum.__name__} has {names} (or DEFAULT)",
            param="pretrained",
            value=choice,
        ) from None
    label = f"{enum.__name__}.{weights.name}"
    origin = {"weights": label, "weights_source": "torchvision"}
    return _url_file(f"torchvision:{model}", weights.url, origin, f" {label}")
