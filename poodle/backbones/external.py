"""Backbones from torchvision and timm: ``torchvision:NAME`` and ``timm:NAME``.

Any classification model of either library becomes a feature extractor whose cached vector is the
pooled pre-logit feature, the input of the model's final classification layer:

- timm: the model is built with ``num_classes=0`` and features are
  ``forward_head(forward_features(x), pre_logits=True)``;
- torchvision: the model's last linear layer (``fc``, ``classifier[-1]``, ``heads.head``, ``head``,
  ...; SqueezeNet's final 1x1 convolution) is replaced by an identity, so ``model(x)`` returns the
  vector that layer would have read.

Nothing is downloaded: torchvision builders get ``weights=None``, timm ``pretrained=False``, and
while a model is built every download entry point of torch.hub and huggingface_hub raises, so a
builder that insists on fetching weights is an error instead of a network access. Weights come from
a file (:func:`poodle.backbones.load_checkpoint`; ``.safetensors`` or a torch state dict), loaded
strictly into the model without its classifier (a checkpoint's classifier is dropped).

The evaluation transform is the model's own: timm's data config (input size, interpolation, crop
fraction, mean/std) through ``timm.data.create_transform``; for torchvision the preset recorded in
the weights enum's ``transforms`` (resize, centre crop, interpolation, ImageNet mean/std), read
without instantiating any weights. Options override the input size, crop fraction and interpolation.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.hub
import torchvision
from torch import nn
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode

from poodle.backbones.base import Backbone
from poodle.errors import CheckpointError, ConfigError, mark

SOURCES = ("torchvision", "timm")
TIMM_HINT = "timm is not installed: pip install 'poodle[timm]' (or pip install timm)"
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


def is_external(name: str) -> bool:
    """Whether ``name`` is ``torchvision:NAME`` or ``timm:NAME``."""
    return isinstance(name, str) and name.split(":", 1)[0] in SOURCES and ":" in name


def split_name(name: str) -> tuple[str, str]:
    """``"timm:resnet50"`` -> ``("timm", "resnet50")``; ConfigError for anything else."""
    source, _, model = name.partition(":")
    if source not in SOURCES or not model:
        raise ConfigError(
            f"backbone {name!r}: external backbones are named torchvision:NAME or timm:NAME",
            param="backbone",
            value=name,
        )
    return source, model


def import_timm() -> Any:
    """The timm module, or a ConfigError saying how to install it."""
    try:
        import timm  # optional dependency (poodle[timm]): imported only when a timm: backbone is used
        import timm.data
    except ImportError:
        # not a caller's value: timm is not installed
        raise ConfigError(TIMM_HINT) from None
    return timm


def file_stem(name: str) -> str:
    """The cache file name of a backbone name (``timm:vit_small`` -> ``timm-vit_small``)."""
    return name.replace(":", "-")


@contextlib.contextmanager
def no_downloads(name: str) -> Iterator[None]:
    """Make every weight-download entry point raise a ConfigError naming ``name`` while inside."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        url = next((a for a in args if isinstance(a, str)), kwargs.get("url", ""))
        raise ConfigError(
            f"backbone {name}: building it tries to download weights ({str(url)[:80]}); poodle never "
            f"downloads: give the weights as a {mark('checkpoint')} file",
            param="backbone",
            value=name,
        )

    patches: list[tuple[Any, str, Any]] = [
        (torch.hub, "load_state_dict_from_url", refuse),
        (torch.hub, "download_url_to_file", refuse),
    ]
    try:
        import huggingface_hub  # optional (comes with timm): patched only where it is installed

        patches += [(huggingface_hub, "hf_hub_download", refuse), (huggingface_hub, "snapshot_download", refuse)]
    except ImportError:
        pass
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    env = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        for obj, attr, fn in patches:
            setattr(obj, attr, fn)
        yield
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env


# ------------------------------------------------------------------------------------------ listing


def torchvision_names() -> list[str]:
    """Classification model builders of torchvision, sorted."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def timm_names() -> list[str] | None:
    """Model names of the installed timm, or None when timm is absent."""
    try:
        timm = import_timm()
    except ConfigError:
        return None
    return sorted(timm.list_models())


# ------------------------------------------------------------------------------------------ transforms


@dataclass(frozen=True)
class EvalTransformSpec:
    """A resolved evaluation transform: resize the shorter side to ``resize``, centre crop ``crop``,
    normalise with ``mean``/``std``. ``description`` is what the cache records."""

    crop: int
    resize: int
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    origin: str

    @property
    def description(self) -> str:
        mean = ", ".join(f"{v:.4g}" for v in self.mean)
        std = ", ".join(f"{v:.4g}" for v in self.std)
        return (
            f"eval ({self.origin}): RGB, resize shorter side to {self.resize} ({self.interpolation}, antialias), "
            f"center crop {self.crop}, normalize mean=({mean}) std=({std})"
        )

    def build(self) -> Callable[[Any], torch.Tensor]:
        """PIL RGB image -> float32 ``[3, crop, crop]`` tensor."""
        mode = T.InterpolationMode(self.interpolation)
        tf = T.Compose(
            [
                T.Resize(self.resize, interpolation=mode, antialias=True),
                T.CenterCrop(self.crop),
                T.ToTensor(),
                T.Normalize(self.mean, self.std),
            ]
        )
        tf.description = self.description  # type: ignore[attr-defined]
        return tf


def _override(
    crop: int, resize: int, interpolation: str, image_size: int | None, crop_pct: float | None, interp: str | None
) -> tuple[int, int, str]:
    if interp is not None and interp not in INTERPOLATIONS:
        raise ConfigError.bad_value("interpolation", interp, f"must be one of {', '.join(INTERPOLATIONS)}")
    if crop_pct is not None and not 0 < crop_pct <= 1:
        raise ConfigError.bad_value("crop_pct", crop_pct, "must lie in (0, 1]")
    pct = crop_pct if crop_pct is not None else crop / resize
    if image_size is not None:
        crop = int(image_size)
    if image_size is not None or crop_pct is not None:
        resize = int(crop / pct)  # timm's and torchvision's rounding: floor(size / crop_pct)
    return crop, resize, interp or interpolation


def eval_transform_spec(
    name: str, *, image_size: int | None = None, crop_pct: float | None = None, interpolation: str | None = None
) -> EvalTransformSpec:
    """The evaluation transform of external backbone ``name`` (from its own configuration),
    with ``image_size`` (crop side), ``crop_pct`` (crop / resize) and ``interpolation`` overriding it."""
    source, model = split_name(name)
    if source == "timm":
        timm = import_timm()
        cfg = timm.get_pretrained_cfg(model)
        if cfg is None:
            raise unknown_model("timm", model, timm.list_models())
        from timm.data import resolve_data_config  # optional dependency, as in import_timm

        dc = resolve_data_config(pretrained_cfg=cfg.to_dict())
        if dc.get("crop_mode", "center") != "center":
            raise ConfigError(
                f"timm:{model}: crop mode {dc['crop_mode']!r} is not supported (only center)",
                param="backbone",
                value=f"timm:{model}",
            )
        crop = int(dc["input_size"][-1])
        resize = int(crop / float(dc["crop_pct"]))
        interp = str(dc["interpolation"])
        interp = interp if interp in INTERPOLATIONS else "bicubic"
        crop, resize, interp = _override(crop, resize, interp, image_size, crop_pct, interpolation)
        return EvalTransformSpec(
            crop, resize, interp, tuple(map(float, dc["mean"])), tuple(map(float, dc["std"])), "timm data config"
        )
    _builder(model)
    kw: dict[str, Any] = {}
    try:
        enum = torchvision.models.get_model_weights(model)
        preset = next(iter(enum)).transforms  # functools.partial(ImageClassification, crop_size=...)
        kw = dict(getattr(preset, "keywords", {}))
    except (ValueError, StopIteration, AttributeError):
        pass
    crop, resize = int(kw.get("crop_size", 224)), int(kw.get("resize_size", 256))
    interp = kw.get("interpolation", InterpolationMode.BILINEAR)
    interp = interp.value if isinstance(interp, InterpolationMode) else str(interp)
    crop, resize, interp = _override(crop, resize, interp, image_size, crop_pct, interpolation)
    mean = tuple(map(float, kw.get("mean", (0.485, 0.456, 0.406))))
    std = tuple(map(float, kw.get("std", (0.229, 0.224, 0.225))))
    return EvalTransformSpec(crop, resize, interp, mean, std, "torchvision weights preset")


# ------------------------------------------------------------------------------------------ models


def unknown_model(library: str, model: str, known: list[str], kind: str = "model") -> ConfigError:
    """The error of a model name ``library`` does not know, with the nearest names it does."""
    near = difflib.get_close_matches(model, known, n=3)
    hint = f"did you mean {', '.join(near)}?" if near else None
    return ConfigError(
        f"{library} has no {kind} {model!r}",
        params=("backbone",),
        hint=hint,
        param="backbone",
        value=f"{library}:{model}",
    )


def _builder(model: str) -> Callable[..., nn.Module]:
    if model not in torchvision.models.list_models(module=torchvision.models):
        raise unknown_model("torchvision", model, torchvision_names(), "classification model")
    return torchvision.models.get_model_builder(model)


def _last_layer(net: nn.Module, model: str) -> tuple[str, nn.Module]:
    """The final classification layer: the last Linear registered (every torchvision classifier
    family ends with one), or SqueezeNet's final 1x1 convolution."""
    if model.startswith("squeezenet"):
        return "classifier.1", net.get_submodule("classifier.1")
    found = [(n, m) for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ConfigError(
            f"torchvision:{model}: no final linear layer found to take the pre-logits from",
            param="backbone",
            value=f"torchvision:{model}",
        )
    return found[-1]


def _set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


class ExternalBackbone(Backbone):
    """A torchvision or timm model as a :class:`Backbone` without heads.

    ``forward_features(x [B, 3, H, W]) -> [B, D]`` are the pooled pre-logits. The checkpoint keys
    are the wrapped model's own (``net`` is looked through by :meth:`weights_module`); the keys of
    the classification layer that was removed (``head_prefix``) are dropped from a checkpoint.
    """

    def __init__(
        self,
        name: str,
        net: nn.Module,
        feature_dim: int,
        head_prefixes: tuple[str, ...],
        forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__(feature_dim)
        self.name = name
        self.net = net
        self._heads = head_prefixes
        self._forward = forward_fn
        self.further = None
        self.fc2 = None
        self.classifier_name = ""

    @property
    def class_head(self) -> None:
        return None

    def head_prefixes(self) -> dict[str, bool]:
        return {p: False for p in self._heads}

    def weights_module(self) -> nn.Module:
        return self.net

    def remap_release(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A timm model's checkpoint in its original layout (DINOv2 as facebookresearch releases it,
        OpenAI CLIP and open_clip image towers, ...) converted to the model's keys by timm's own
        ``checkpoint_filter_fn`` of the model's module, as timm converts its pretrained files. A state
        dict that already fits the model is left as it is; what the conversion leaves unmatched is
        for the strict load to list."""
        if not self.name.startswith("timm:") or _fits(self.net, state_dict, self._heads):
            return state_dict
        module = sys.modules.get(type(self.net).__module__)
        convert = getattr(module, "checkpoint_filter_fn", None)
        if convert is None:
            return state_dict
        sd = dict(state_dict)  # the filters pop entries (DINOv2's mask_token) from what they are given
        if "class_embedding" in sd and "conv1.weight" in sd:  # a CLIP image tower saved alone (model.visual)
            sd = {f"visual.{k}": v for k, v in sd.items()}
        try:
            try:
                out = convert(sd, self.net)
            except TypeError:  # filters of one argument (timm's load_pretrained allows them too)
                out = convert(sd)
        except Exception as e:  # noqa: BLE001 - a filter fails in its own ways on a foreign file: one line
            raise CheckpointError(
                f"{self.name}: timm's {type(self.net).__module__}.checkpoint_filter_fn cannot convert the "
                f"checkpoint ({type(e).__name__}: {str(e).strip()[:160]})",
                param="backbone",
                value=self.name,
            ) from None
        return dict(out)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ConfigError(
                f"{self.name} expects images [B, 3, H, W], got a tensor of shape {list(x.shape)}",
                param="x",
                value=tuple(x.shape),
            )
        return self._forward(self.net, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.forward_features(x)

    def extra_repr(self) -> str:
        return f"name={self.name}, feature_dim={self.feature_dim}"


def _fits(net: nn.Module, state_dict: dict[str, torch.Tensor], heads: tuple[str, ...]) -> bool:
    """Whether ``state_dict`` without the ``heads`` keys has exactly ``net``'s keys and shapes."""
    own = net.state_dict()
    sd = {k: v for k, v in state_dict.items() if not k.startswith(heads)}
    return sd.keys() == own.keys() and all(tuple(v.shape) == tuple(own[k].shape) for k, v in sd.items())


def _timm_forward(net: Any, x: torch.Tensor) -> torch.Tensor:
    return net.forward_head(net.forward_features(x), pre_logits=True)


def _torchvision_forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.flatten(net(x), 1)


def build_external(name: str, image_size: int | None = None) -> ExternalBackbone:
    """Build ``torchvision:NAME`` / ``timm:NAME`` with fresh random weights and no classifier,
    downloading nothing (a builder that tries is a ConfigError).

    ``image_size``: the input side it will see. A timm model whose default input size differs is
    built with ``dynamic_img_size=True`` where it has that option (ViTs: the position embeddings
    are interpolated at run time, so a checkpoint made at the default size still loads).
    """
    source, model = split_name(name)
    if source == "timm":
        timm = import_timm()
        if not timm.is_model(model):
            raise unknown_model("timm", model, timm.list_models())
        cfg0 = timm.get_pretrained_cfg(model)
        default = int(cfg0.input_size[-1]) if cfg0 is not None and cfg0.input_size else None
        with no_downloads(name):
            net = None
            if image_size is not None and default is not None and int(image_size) != default:
                try:
                    net = timm.create_model(model, pretrained=False, num_classes=0, dynamic_img_size=True)
                except TypeError:  # a model without that option (CNNs take any size anyway)
                    net = None
            if net is None:
                net = timm.create_model(model, pretrained=False, num_classes=0)
        cfg = getattr(net, "pretrained_cfg", None) or {}
        heads = cfg.get("classifier") or ()
        heads = (heads,) if isinstance(heads, str) else tuple(heads)
        dim = int(getattr(net, "head_hidden_size", None) or net.num_features)
        return ExternalBackbone(name, net, dim, tuple(h + "." for h in heads), _timm_forward)
    builder = _builder(model)
    kwargs: dict[str, Any] = {"weights": None}
    if model in ("googlenet", "inception_v3"):
        kwargs["aux_logits"] = False  # released weights have no auxiliary heads; eval never uses them
        kwargs["init_weights"] = False
    with no_downloads(name):
        net = builder(**kwargs)
    path, layer = _last_layer(net, model)
    dim = int(layer.in_features) if isinstance(layer, nn.Linear) else int(cast(int, layer.in_channels))
    _set_module(net, path, nn.Identity())
    return ExternalBackbone(name, net, dim, (path + ".",), _torchvision_forward)
