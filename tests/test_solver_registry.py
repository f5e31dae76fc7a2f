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
    with pytest.raises(ConfigError, match="unknown method 'nope'; known methods: .*, poodle, proto, ") as e:
        solvers.get("nope")
    assert "did you mean" not in str(e.value)  # nothing close: the list alone
    # a typo: the closest name, then the list as ever
    with pytest.raises(ConfigError, match=r"^unknown method 'protoo' \(did you mean 'proto'\?\); known methods: ") as e:
        solvers.get("protoo")
    assert str(e.value).endswith(", ".join(solvers.available()))


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


# ------------------------------------------------- a method's facts at its @register; the backend


def test_method_facts_are_read_from_the_registry():
    from poodle import costmodel
    from poodle.cli.solve import _solver_options, method_flag, solve

    # the Triton step's methods, the cost model's fixed-step methods and iteration fields
    assert {m for m in solvers.available() if solvers.get(m).triton_step} == {
        "poodle", "ce", "naive-ood", "tim-gd", "alpha-tim", "entropy-min"
    }  # fmt: skip
    assert {m for m in solvers.available() if solvers.get(m).floor.fixed_steps} == {
        "poodle", "ce", "naive-ood", "tim-gd", "alpha-tim", "entropy-min", "tim-adm", "paddle"
    }  # fmt: skip
    kmeans = solvers.make_config("kmeans", {"max_iter": 7})
    assert costmodel.method_steps("kmeans", kmeans) == 7
    can_t = solvers.make_config("can-t", {"step": 10})  # iterations -1: Nq // step
    assert costmodel.method_steps("can-t", can_t, costmodel.Workload(way=5, query=15)) == 7
    assert costmodel.method_steps("can-t", solvers.make_config("can-t", {"iterations": 3})) == 3
    # the CLI's own flags of a method come from its registration, and each is an option of `solve`
    own = {f: v for f, v in _solver_options().items() if v[1] is not None}
    assert own == {"pull_weight": ("alpha", "poodle"), "push_weight": ("beta", "poodle"),
                   "entropy_alpha": ("alpha", "alpha-tim")}  # fmt: skip
    assert set(own) <= {p.name for p in solve.params}
    assert (
        method_flag("alpha-tim", "alpha") == "--entropy-alpha"
        and method_flag("pt-map", "alpha") == "--set pt-map.alpha=V"
    )


def test_register_refuses_a_flag_for_a_field_its_config_lacks():
    from poodle.solvers.base import register

    @dataclass
    class Cfg:
        steps: int = 1

    with pytest.raises(TypeError, match="names flags for fields its config lacks: gamma"):
        register("flag-test", Cfg, flags={"my_gamma": "gamma"})(lambda batch, cfg: None)
    assert "flag-test" not in solvers.available()


def test_the_backend_is_a_value_and_its_report_is_its_own():
    from poodle import defaults
    from poodle.solvers import backend

    # the library's choices are RunOptions' choices
    assert backend.CUDA_STEPS == defaults.CUDA_STEPS and backend.Backend().cuda_step == defaults.CUDA_STEP
    with pytest.raises(ConfigError, match="cuda_step must be one of torch, triton"):
        backend.Backend(cuda_step="cuda")
    g = torch.Generator().manual_seed(0)
    batch = solvers.EpisodeBatch(
        torch.randn(2, 5, 8, generator=g), torch.arange(5).repeat(2, 1), torch.randn(2, 6, 8, generator=g), None, 5
    )
    cfg = solvers.make_config("tim-gd", {"steps": 2})
    a, b = backend.Backend(), backend.Backend(native=False)
    solvers.run("tim-gd", batch, cfg, backend=a)
    solvers.run("tim-gd", batch, cfg, backend=b)
    assert b.formulation("tim-gd", "cpu") == "torch (the fused kernel switched off)"
    assert a.formulation("tim-gd", "cpu") != b.formulation("tim-gd", "cpu")
    assert a.with_(cuda_step="triton").report is a.report  # a changed copy reports into the same
    assert backend.current() == backend.Backend()  # nothing left behind by the calls


def test_solvers_import_nothing_above_them():
    """The solver layer (the methods, their engines, the backend) imports no module of the layers
    above it (the cost model, evaluate, the pipeline...): those read the registry, not the reverse,
    and there is no import circle between them (the cost model's sizing of the Triton step reaches
    the step as the backend's ``launch_plan``)."""
    import ast
    import pathlib

    allowed = ("poodle.solvers", "poodle.errors", "poodle.options", "poodle.events")
    root = pathlib.Path(solvers.__file__).parent
    above = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("poodle"):
                names = [node.module] if node.module != "poodle" else [f"poodle.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("poodle")]
            above += [f"{path.name}: {n}" for n in names if not n.startswith(allowed)]
    assert above == []
