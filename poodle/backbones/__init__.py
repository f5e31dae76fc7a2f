"""Backbones of the POODLE release (Le et al., "POODLE: Improving Few-shot Learning via Penalizing
Out-of-Distribution Samples", NeurIPS 2021), with the release's module and state-dict key names so
the authors' checkpoints load strictly.

    >>> from poodle import backbones
    >>> model = backbones.build("resnet12")                 # no heads: a feature extractor
    >>> sha = backbones.load_checkpoint(model, "model_best.pth.tar")
    >>> feats = model.eval().forward_features(images)       # [B, 3, 84, 84] -> [B, 640]

``torchvision:NAME`` and ``timm:NAME`` name any model of those libraries (see
:mod:`poodle.backbones.external`): ``build_external(name)`` gives the same interface without heads.

``build(name, num_classes=64, rotation_head=True)`` adds the classifier and the rotation head used
for pre-training; ``model(x)`` then returns ``(class_logits [B, 64], rot_logits [B, 4])``.
"""

# Importing a family module registers its variants.
from poodle.backbones import conv4, densenet, mobilenet, resnet, resnet12, wrn  # noqa: F401,E402
from poodle.backbones.base import ALIASES, BACKBONES, Backbone, BackboneSpec, available, build, get_spec, register
from poodle.backbones.checkpoint import (
    check_state_dict,
    guess_architecture,
    load_checkpoint,
    load_state_dict_strict,
    read_checkpoint,
    remap_state_dict,
    save_checkpoint,
)
from poodle.backbones.external import (
    EvalTransformSpec,
    ExternalBackbone,
    build_external,
    eval_transform_spec,
    is_external,
)

__all__ = [
    "ALIASES",
    "BACKBONES",
    "Backbone",
    "BackboneSpec",
    "available",
    "build",
    "get_spec",
    "register",
    "check_state_dict",
    "guess_architecture",
    "load_checkpoint",
    "load_state_dict_strict",
    "read_checkpoint",
    "remap_state_dict",
    "save_checkpoint",
    "EvalTransformSpec",
    "ExternalBackbone",
    "build_external",
    "eval_transform_spec",
    "is_external",
]
