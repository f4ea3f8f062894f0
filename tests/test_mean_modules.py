"""Prior means are modules the strategies receive, and q(ũ)'s mean a second object (docs/derivations.md
§5c, §7a): the ``prior_mean`` strings are parsed once where a variant is built, never tested in a conditioning path."""

import ast
import itertools
import pathlib
import re

import torch

import gpattn
from gpattn.prior_means import make_correlated_mean, make_prior_mean
from gpattn.variational.means import (
    OWN_VALUES,
    AmortisedValueMean,
    CentredVariationalMean,
    CorrelatedSoftmaxMean,
    SoftmaxMean,
    ZeroMean,
)
from gpattn.variational.sgpa import SGPAVariationalStrategy

VARIATIONAL = pathlib.Path(gpattn.__file__).parent / "variational"
#: the names whose comparison would be a string test of a prior mean, and the strings themselves
NAMES = {"prior_mean", "mean_values", "v_mean"}
STRINGS = {"attention", "softmax", "softmax-separate", "zero", "v_mean"}
#: where a name is parsed or a pairing chosen (the one place a string may be compared or a form's class tested)
PARSERS = {"check_prior_mean", "variational_mean_for"}
#: the classes of the forms: an ``isinstance`` test against one asks which form it is
FORM_CLASSES = {
    "ZeroMean", "AttentionMean", "SoftmaxMean", "CorrelatedSoftmaxMean", "AmortisedValueMean", "CentredVariationalMean",
}
#: a flag that would name which form a q(ũ)-mean is (the decoupled γ-basis asks the object for its terms instead)
FORM_FLAGS = {"centred"}


def _form_test(node: ast.AST) -> bool:
    """Whether ``node`` tests which form an object is: ``isinstance(x, <a form's class>)`` or a read of a form flag."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
        classes = node.args[1] if len(node.args) > 1 else None
        names = classes.elts if isinstance(classes, ast.Tuple) else [classes]
        return any(getattr(n, "id", getattr(n, "attr", None)) in FORM_CLASSES for n in names)
    return (isinstance(node, ast.Attribute) and node.attr in FORM_FLAGS) or (
        isinstance(node, ast.Name) and node.id in FORM_FLAGS
    )


def _string_tests(tree: ast.AST) -> list[int]:
    """Line numbers of comparisons that read a prior-mean name or string, outside :data:`PARSERS`."""
    found = []

    def visit(node, inside_parser=False):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside_parser = inside_parser or node.name in PARSERS
        # `x is None` asks whether an input was given, not which form: only ==, !=, in, not in test a value
        if isinstance(node, ast.Compare) and not inside_parser and not all(
            isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops
        ):
            for side in (node.left, *node.comparators):
                named = (isinstance(side, ast.Name) and side.id in NAMES) or (
                    isinstance(side, ast.Attribute) and side.attr in NAMES
                )
                if named or (isinstance(side, ast.Constant) and side.value in STRINGS):
                    found.append(node.lineno)
                    break
        if not inside_parser and _form_test(node):
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, inside_parser)

    visit(tree)
    return found


def test_no_form_test_of_the_means_in_variational():
    offenders = {
        path.name: lines
        for path in sorted(VARIATIONAL.glob("*.py"))
        if (lines := _string_tests(ast.parse(path.read_text())))
    }
    assert not offenders, f"form tests (a prior-mean string, a form's class or flag; file: lines): {offenders}"


#: the project check's pattern: a prior-mean string, a test of ``mean_values``, the own-values projection's name, a test
#: of the mean module, a Gram flag a caller would branch on
CHECK = re.compile(
    r'prior_mean *(==|!=|in )|mean_values is|"softmax-separate"|v_mean|mean_module is (not )?None|uses_gram'
)
#: the three lines that may match: the separate means' public spelling (one constant, cgp/scgp's and kep-svgp's),
#: the own-values projection's name (one constant), and the refusal of ``mean_values`` given to a mean that owns none
#: (an input check, not a form test)
ALLOWED = {
    ("means.py", 'SEPARATE = "softmax-separate"'),
    ("means.py", 'OWN_VALUES = ("v_mean",)'),
    ("means.py", "if mean_values is not None:"),
}


def test_the_spelling_lives_outside_the_conditioning_code():
    """The names are parsed in gpattn/prior_means.py; gpattn/variational/ reads no name and no flag of a form: what a
    form computes, its module computes (a mean that reads the Gram evaluates it; a q(ũ)-mean decides whether the
    Gram-free path runs)."""
    found = {
        (path.name, line.strip())
        for path in sorted(VARIATIONAL.glob("*.py"))
        for line in path.read_text().splitlines()
        if CHECK.search(line)
    }
    assert found <= ALLOWED, (
        f"string/flag tests of the prior-mean form in gpattn/variational/: {sorted(found - ALLOWED)}"
    )


def test_the_check_finds_a_string_test():
    assert _string_tests(ast.parse("def f(s):\n    return s.prior_mean == 'zero'\n")) == [2]
    assert _string_tests(ast.parse("def f(s):\n    return 'v_mean' in s.projections\n")) == [2]
    assert _string_tests(ast.parse("def f(mean_values):\n    return mean_values is None\n")) == []
    assert _string_tests(ast.parse("def check_prior_mean(prior_mean):\n    return prior_mean in ('zero',)\n")) == []
    # which q(ũ)-mean it is, by a flag or by class, is a form test too
    assert _string_tests(ast.parse("def f(s):\n    if s.variational_mean.centred:\n        pass\n")) == [2]
    assert _string_tests(ast.parse("def f(s):\n    return isinstance(s.mean_module, (nn.Module, ZeroMean))\n")) == [2]
    assert _string_tests(ast.parse("def f(s):\n    return isinstance(s.prior_mean, nn.Module)\n")) == []


def test_strings_build_the_modules():
    kernel = gpattn.build_attention("sgpa", 8, 2).kernel
    assert isinstance(make_prior_mean("zero", kernel), ZeroMean)
    assert isinstance(make_prior_mean("softmax", kernel), SoftmaxMean)
    mean = ZeroMean()
    assert make_prior_mean(mean, kernel) is mean and make_correlated_mean(mean) is mean
    separate = make_correlated_mean("softmax-separate")
    assert isinstance(separate, CorrelatedSoftmaxMean) and separate.projections == OWN_VALUES == ("v_mean",)
    assert make_correlated_mean("softmax").projections == () and make_correlated_mean("zero").projections == ()
    layer = gpattn.build_attention("scgp", 8, 2, num_inducing=3, num_inducing_keys=3)
    assert "v_mean" in layer.projections and layer.strategy.prior_mean == "softmax-separate"


def test_a_strategy_given_modules_equals_one_given_the_name():
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa", 8, 2, prior_mean="zero").double()
    s = layer.strategy
    keys, values = torch.randn(2, 2, 5, 4, dtype=torch.float64), torch.randn(2, 2, 5, 4, dtype=torch.float64)
    given = SGPAVariationalStrategy(
        s.kernel, s.variational_distribution, jitter=s.jitter, covariance=s.covariance, prior_mean=ZeroMean(),
        variational_mean=AmortisedValueMean(),
    )
    for mask in (None, torch.ones(5, 5, dtype=torch.bool).triu(1)[None, None]):
        a, b = s.condition(keys, values, mask), given.condition(keys, values, mask)
        assert torch.equal(a.mean, b.mean) and torch.equal(a.kl_divergence(), b.kl_divergence())
    assert isinstance(gpattn.build_attention("sgpa", 8, 2).strategy.variational_mean, CentredVariationalMean)


def test_the_decoupled_strategy_asks_its_q_mean_object_for_the_gamma_basis():
    """sgpa-decoupled given the q(ũ)-mean objects equals one built from the name, on every conditioning path (self,
    causal, general per-query mask, cross); the object alone decides the γ-basis (a centred q(ũ) leaves no γ-part,
    whatever the prior mean)."""
    from gpattn.variational.sgpa_decoupled import DecoupledSGPAVariationalStrategy

    torch.manual_seed(0)
    general = torch.zeros(5, 5, dtype=torch.bool)
    general[0, 2] = general[3, 1] = True
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    q, v, kg = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    kg = kg[0, :, :3]  # shape: (H, M, Dh)
    calls = [dict(), dict(mask=causal[None, None]), dict(mask=general[None, None]),
             dict(query_inputs=torch.randn(2, 2, 4, 4, dtype=torch.float64))]
    for prior_mean, q_mean in itertools.product(("zero", "attention"), (AmortisedValueMean, CentredVariationalMean)):
        s = gpattn.build_attention("sgpa-decoupled", 8, 2, num_global=3, prior_mean=prior_mean).double().strategy
        given = DecoupledSGPAVariationalStrategy(
            s.kernel, s.variational_distribution, s.inducing_inputs.detach(), jitter=s.jitter,
            covariance=s.covariance, prior_mean=make_prior_mean(prior_mean, s.kernel), variational_mean=q_mean(),
        )
        paired = type(s.variational_mean) is q_mean  # the pairing the name builds
        for call in calls:
            a, b = s.condition(q, v, kg, **call), given.condition(q, v, kg, **call)
            assert b.has_gamma == (q_mean is AmortisedValueMean)
            if paired:
                assert type(a) is type(b) and torch.equal(a.mean, b.mean)
                assert torch.equal(a.kl_divergence(), b.kl_divergence())


def test_the_moved_parsers_say_where_they_went():
    import pytest

    import gpattn.variational.kep_svgp as kep
    import gpattn.variational.means as means

    for name in ("PRIOR_MEANS", "check_prior_mean"):  # what gpattn 0.2.0 exported (tests/test_release_compat.py)
        with pytest.raises(AttributeError, match=rf"moved to gpattn\.prior_means\.{name}"):
            getattr(means, name)
    for module, name in ((means, "make_prior_mean"), (means, "CGP_PRIOR_MEANS"), (kep, "make_kep_mean")):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'$"):  # no release had them
            getattr(module, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = means.nothing
