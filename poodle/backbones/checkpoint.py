"""Saving and strictly loading backbone checkpoints, including the POODLE authors' released ones
(Le et al., NeurIPS 2021; github lehduong/poodle).

The release wraps every model in ``torch.nn.DataParallel`` before saving, so its files hold
``{"state_dict": {"module.<key>": tensor}, "arch": ..., "epoch": ..., "optimizer": ...}``; its own
loader copies whatever keys happen to match and never complains. Here loading is one explicit remap
(:func:`remap_state_dict`: strip ``module.``, drop heads the model lacks, family fixes) followed by
a strict load that lists every missing key, unexpected key and shape mismatch.
"""

from __future__ import annotations

import functools
import io
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from poodle.backbones.base import BACKBONES, Backbone
from poodle.errors import CheckpointError, ConfigError, mark
from poodle.utils import atomic_write, file_sha256, resolve_path

PREFIX = "module."
# First key component of every head any registered backbone may carry.
HEAD_ROOTS = frozenset({"fc", "linear", "classifier", "further", "fc2"})
_SHOWN = 5  # keys listed per category in an error message
# Top-level keys under which checkpoint files of the release, timm, DeiT, MAE, ... keep the weights.
WRAPPERS = ("state_dict", "model")


def _read_safetensors(p: Path) -> dict[str, torch.Tensor]:
    try:
        # optional in practice (only .safetensors files need it; the dev venvs lack it): without it every
        # other checkpoint still loads and a .safetensors one gets the install hint below
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:
        raise CheckpointError(
            f"{p}: reading .safetensors files needs safetensors: pip install safetensors", param="checkpoint", value=p
        ) from None
    try:
        state = load_file(str(p), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{p} is not a safetensors file ({str(e).strip().splitlines()[0][:160]})", param="checkpoint", value=p
        ) from None
    if not state:
        raise CheckpointError(f"{p} holds no tensors", param="checkpoint", value=p)
    return dict(state)


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load ``path`` with ``weights_only=True`` onto the CPU.

    Returns ``(state_dict, meta)``: the state dict (from ``{"state_dict": ...}``, ``{"model": ...}``
    or a bare state dict, keys as stored; a ``.safetensors`` file is read with safetensors) and
    the file's other top-level entries (``arch``, ``epoch``, ...).
    Raises CheckpointError naming the file when it is missing, not a torch file, not loadable
    with ``weights_only=True``, or holds no state dict.
    """
    p = resolve_path(path, what="checkpoint")
    if not p.is_file():
        raise CheckpointError(f"checkpoint {p} does not exist", param="checkpoint", value=path)
    if p.stat().st_size == 0:  # torch says only "EOFError"
        raise CheckpointError(f"{p} is not a torch checkpoint (an empty file)", param="checkpoint", value=path)
    if p.suffix == ".safetensors":
        return _read_safetensors(p), {}
    try:
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of foreign files; the error below says enough.
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types here (UnpicklingError, RuntimeError, EOFError...)
        text = str(e).strip()
        refused = _refused_globals(p, text)
        if refused:
            raise CheckpointError(
                f"{p} holds Python object(s) that torch.load(weights_only=True) refuses to "
                f"unpickle: {', '.join(refused[:5])}{', ...' if len(refused) > 5 else ''}; "
                f"only tensors and plain containers are accepted (re-save the state dict "
                f"alone)",
                param="checkpoint",
                value=path,
            ) from None
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # The weights-only unpickler buries the real cause ("Unsupported operand 100") mid-message.
        detail = next((ln for ln in lines if ln.startswith("Unsupported")), lines[0] if lines else "")
        # torch's zip reader goes on about "an internal miniz error" and file corruption: its first sentence says it
        detail = detail.split(". ")[0]
        raise CheckpointError(
            f"{p} is not a torch checkpoint ({type(e).__name__}: {detail[:160]})", param="checkpoint", value=path
        ) from e
    wrapper = next((k for k in WRAPPERS if isinstance(obj, Mapping) and isinstance(obj.get(k), Mapping)), None)
    if wrapper is not None:
        state, meta = obj[wrapper], {k: v for k, v in obj.items() if k != wrapper}
    elif isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        state, meta = obj, {}
    else:
        what = (
            f"a dict with keys {sorted(map(str, obj))[:8]}" if isinstance(obj, Mapping) else f"a {type(obj).__name__}"
        )
        raise CheckpointError(
            f"{p} holds {what}, not a state dict or {{'state_dict': ...}}", param="checkpoint", value=path
        )
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise CheckpointError(
                f"{p}: state dict entry {k!r} is a {type(v).__name__}, not a tensor", param="checkpoint", value=path
            )
    return dict(state), meta


def _refused_globals(path: Path, text: str) -> list[str]:
    """The globals (``module.Name``) that made the weights-only load fail, or [] if that was not the
    cause. torch >= 2.5 lists them without unpickling (``get_unsafe_globals_in_checkpoint``); the
    error text (whose wording changes between versions) is only the fallback."""
    if not re.search(r"global", text, re.IGNORECASE):
        return []
    lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if lister is not None:
        try:
            found = [str(g) for g in lister(path)]
            if found:
                return found
        except Exception:  # noqa: BLE001 - fall back to the message
            pass
    return list(
        dict.fromkeys(
            re.findall(r"GLOBAL\s+([A-Za-z_][\w.]*)", text, re.IGNORECASE)
            or re.findall(r"global[:\s]+([A-Za-z_][\w.]*\.[\w]+)", text, re.IGNORECASE)
        )
    )


def remap_state_dict(model: Backbone, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turn a foreign state dict into one for ``model`` (the input is not modified).

    1. strip the ``module.`` prefix of DataParallel / DistributedDataParallel;
    2. apply the family's fixes of the release (:meth:`Backbone.remap_release`; DenseNet's fc2);
    3. drop the heads (classifier, ``further``, ``fc2``) that ``model`` was built without;
    4. add BatchNorm ``num_batches_tracked`` counters a (pre-1.0 PyTorch) file lacks, as 0.

    Everything else is left for the strict load to judge.
    """
    sd = dict(model.remap_release({_strip(k): v for k, v in state_dict.items()}))
    absent = tuple(p for p, present in model.head_prefixes().items() if not present)
    if absent:
        sd = {k: v for k, v in sd.items() if not k.startswith(absent)}
    for k, v in _weights_module(model).state_dict().items():
        if (
            k.endswith(".num_batches_tracked")
            and k not in sd
            and k[: -len("num_batches_tracked")] + "running_mean" in sd
        ):
            sd[k] = torch.zeros_like(v)
    return sd


def _weights_module(model: nn.Module) -> nn.Module:
    """The module whose state dict a checkpoint describes: the model itself, or the wrapped
    torchvision/timm network of an external backbone (``weights_module()``)."""
    fn = getattr(model, "weights_module", None)
    return fn() if callable(fn) else model


def _strip(key: str) -> str:
    while key.startswith(PREFIX):
        key = key[len(PREFIX) :]
    return key


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DataParallel / DistributedDataParallel wrappers."""
    while not isinstance(model, Backbone) and isinstance(getattr(model, "module", None), nn.Module):
        model = cast(nn.Module, model.module)
    return model


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def _listing(keys: list[str]) -> str:
    more = ", ..." if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


@functools.cache
def _signature(name: str) -> frozenset[tuple[str, tuple[int, ...]]]:
    """(key, shape) pairs of backbone ``name`` without heads; built on the meta device (no memory)."""
    with torch.device("meta"):
        model = BACKBONES[name].constructor(num_classes=0, rotation_head=False)
    return frozenset((k, tuple(v.shape)) for k, v in model.state_dict().items())


def guess_architecture(state_dict: Mapping[str, torch.Tensor]) -> tuple[str, bool] | None:
    """The registered backbone whose (key, shape) set best matches ``state_dict``'s non-head entries
    (``module.`` stripped): ``(name, exact)``, or None when nothing overlaps by half."""
    sig = frozenset((_strip(k), tuple(v.shape)) for k, v in state_dict.items())
    sig = frozenset(e for e in sig if e[0].split(".", 1)[0] not in HEAD_ROOTS)
    if not sig:
        return None
    best, best_score = None, 0.5
    for name in sorted(BACKBONES):
        ref = _signature(name)
        if ref == sig:
            return name, True
        score = len(ref & sig) / len(ref | sig)
        if score > best_score:
            best, best_score = name, score
    return (best, False) if best is not None else None


def check_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> tuple[list[str], list[str], list[str]]:
    """``(missing, unexpected, mismatched)`` of loading ``state_dict`` strictly into ``model``;
    mismatched entries read ``"key: checkpoint [a, b], model [c, d]"``."""
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    mismatched = [
        f"{k}: checkpoint {_shape(v)}, model {_shape(own[k])}"
        for k, v in state_dict.items()
        if k in own and v.shape != own[k].shape
    ]
    return missing, unexpected, mismatched


def load_state_dict_strict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    source: str = "state dict",
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Remap ``state_dict`` (:func:`remap_state_dict`) and load it strictly into ``model``.

    Raises CheckpointError listing missing keys, unexpected keys and shape mismatches, and naming
    the architecture the checkpoint seems to be for.
    """
    model = cast(Backbone, _unwrap(model))
    sd = remap_state_dict(model, state_dict)
    target = _weights_module(model)
    missing, unexpected, mismatched = check_state_dict(target, sd)
    if not (missing or unexpected or mismatched):
        # load_state_dict casts silently: integer weights would load "strictly" as truncated values
        # (an all-zero network from a checkpoint of small floats stored as int).
        own = target.state_dict()
        wrong = [f"{k} ({v.dtype})" for k, v in sd.items() if own[k].is_floating_point() and not v.is_floating_point()]
        if wrong:
            raise CheckpointError(
                f"{source}: {len(wrong)} tensor(s) where {getattr(model, 'name', 'the model')} "
                f"has floating-point values hold non-floating data: {_listing(wrong)}",
                param="checkpoint",
                value=source,
            )
    if missing or unexpected or mismatched:
        name = getattr(model, "name", type(model).__name__)
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys ({_listing(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys ({_listing(unexpected)})")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatches ({_listing(mismatched)})")
        msg = f"{source} does not fit {name}: " + ", ".join(parts)
        # the guess compares with the release's backbones; an external model is none of them
        guess = None if model is not target else guess_architecture(state_dict)
        file_arch = (meta or {}).get("arch")
        if guess is not None and guess[0] != name:
            msg += f"; it looks like a {guess[0]} checkpoint" if guess[1] else f"; it is closest to {guess[0]}"
        elif guess is None and isinstance(file_arch, str) and file_arch != name:
            msg += f"; the file says arch {file_arch!r}"
        head = getattr(model, "classifier_name", None)
        w = sd.get(f"{head}.weight")
        if (
            not missing
            and not unexpected
            and head
            and w is not None
            and all(m.startswith(f"{head}.") for m in mismatched)
        ):
            msg += (
                f"; its classifier has {w.shape[0]} classes: build with num_classes="
                f"{w.shape[0]}, or 0 to leave the classifier out"
            )
        raise CheckpointError(msg, param="checkpoint", value=source)
    target.load_state_dict(sd, strict=True)


def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> str:
    """Load the checkpoint file ``path`` strictly into ``model``; return the file's sha256 (hex).

    Accepts ``{"state_dict": ...}`` or a bare state dict, keys with or without ``module.``; heads
    the model was built without are ignored, everything else must match exactly. The tensors are
    copied into the model's parameters, whatever device the model is on.
    """
    state, meta = read_checkpoint(path)
    load_state_dict_strict(model, state, source=f"checkpoint {path}", meta=meta)
    return file_sha256(path)


def save_checkpoint(model: nn.Module, path: str | os.PathLike, **extra: Any) -> Path:
    """Write ``{"state_dict": {"module." + key: tensor}, "arch": model.name, **extra}`` (the
    release's layout) to ``path`` atomically; tensors are stored on the CPU. A DataParallel /
    DistributedDataParallel wrapper is looked through. ``extra`` values must be loadable with
    ``weights_only=True`` (numbers, strings, lists, dicts, tensors)."""
    clash = {"state_dict", "arch"} & extra.keys()
    if clash:
        raise ConfigError(
            f"save_checkpoint: {sorted(clash)} are written by save_checkpoint itself",
            param="extra",
            value=sorted(clash),
        )
    model = _unwrap(model)
    # contiguous: a channels-last model's weights are stored in the usual layout, as any reader expects
    state = {PREFIX + k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    obj = {"state_dict": state, "arch": getattr(model, "name", type(model).__name__), **extra}
    # serialised in memory, then written with plain file I/O: a full disk is one clean error naming
    # the file (torch's own writer reports it as an internal assertion)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write(path, buf.getbuffer())


def checkpoint_digest(checkpoint: str | os.PathLike | None) -> str:
    """The sha256 (hex) of a checkpoint file, ``"none"`` without one (random weights); a missing
    file is a CheckpointError."""
    if checkpoint is None:
        return "none"
    ck = resolve_path(Path(checkpoint).expanduser(), "checkpoint")
    if not ck.is_file():
        raise CheckpointError(f"{mark('checkpoint')} {ck} does not exist", param="checkpoint", value=checkpoint)
    return file_sha256(ck)
