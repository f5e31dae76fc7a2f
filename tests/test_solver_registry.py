"""The solver registry: discovery, config building from named options, clear errors."""

from dataclasses import dataclass

import pytest
import torch

from poodle import solvers
from poodle.errors import ConfigError
from poodle.solvers.base import SolverInfo, build_config, class_means, neg_half_sqdist


@dataclass(frozen=True)
class _Cfg:
    steps: int = 10
    lr: float = 1e-3
    transductive: bool = False
    name: str = "x"


def _info(transductive="optional"):
    return SolverInfo("dummy", lambda b, c: None, _Cfg, transductive, False, None, "")


def test_build_config_coerces_types_and_ignores_foreign_keys():
    cfg = build_config(_info(), {"steps": "25", "lr": 0.5, "transductive": "true", "alpha": 3})
    assert cfg == _Cfg(steps=25, lr=0.5, transductive=True)


def test_build_config_strict_names_unknown_option_and_known_ones():
    with pytest.raises(ConfigError, match=r"no option 'alpha'.*lr, name, steps, transductive"):
        build_config(_info(), {"alpha": 1.0}, strict=True)


@pytest.mark.parametrize("value", ["abc", 2.5, True])
def test_build_config_rejects_wrong_type(value):
    with pytest.raises(ConfigError, match="'steps' of method 'dummy' expects an int"):
        build_config(_info(), {"steps": value})


def test_inductive_only_method_refuses_transductive():
    with pytest.raises(ConfigError, match="inductive only"):
        build_config(_info("never"), {"transductive": True})
    assert build_config(_info("always"), {"transductive": True}) == _Cfg()


def test_unknown_method_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        solvers.get("nope")


def test_class_means_and_logits_match_plain_formulas():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([[0, 0, 1, 1, 2, 2]] * 3)
    w = class_means(x, labels, 3)
    assert torch.allclose(w[:, 1], x[:, 2:4].mean(1))
    scale = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).view(3, 1, 1)
    logits = neg_half_sqdist(x, w, scale)
    plain = -(scale / 2) * ((x[:, :, None, :] - w[:, None, :, :]) ** 2).sum(-1)
    assert torch.allclose(logits, plain)
    # a class with no member gives a zero prototype, not NaN
    assert torch.equal(
        class_means(x, torch.zeros(3, 6, dtype=torch.long), 3)[:, 2], torch.zeros(3, 4, dtype=torch.float64)
    )


def test_every_method_registered_with_a_summary_and_an_alias_resolves():
    names = solvers.available()
    for expected in [
        "proto",
        "ce",
        "poodle",
        "naive-ood",
        "tim-gd",
        "tim-adm",
        "soft-kmeans",
        "kmeans",
        "bayes-kmeans",
        "mean-shift",
        "can-t",
        "laplacianshot",
        "bd-cspn",
        "entropy-min",
        "pt-map",
    ]:
        assert expected in names
        assert solvers.get(expected).summary
    assert "tim" not in names and solvers.get("tim").name == "tim-gd"


def test_poodle_needs_negatives_only_when_it_pushes():
    info = solvers.get("poodle")
    assert info.needs_negatives(solvers.make_config("poodle", {"beta": 0.5}))
    assert not info.needs_negatives(solvers.make_config("poodle", {"beta": 0}))
    assert not solvers.get("proto").needs_negatives(solvers.make_config("proto"))
