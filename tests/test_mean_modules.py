"""Prior means are modules the strategies receive, and q(ũ)'s mean a second object (docs/derivations.md
§5c, §7a): the ``prior_mean`` strings are parsed once where a variant is built, never tested in a conditioning path."""

import ast
import pathlib

import torch

import gpattn
from gpattn.variational.means import (
    AmortisedValueMean,
    CentredVariationalMean,
    CorrelatedSoftmaxMean,
    SoftmaxMean,
    ZeroMean,
    make_correlated_mean,
    make_prior_mean,
)
from gpattn.variational.sgpa import SGPAVariationalStrategy

VARIATIONAL = pathlib.Path(gpattn.__file__).parent / "variational"
#: the names whose comparison would be a string test of a prior mean, and the strings themselves
NAMES = {"prior_mean", "mean_values", "v_mean"}
STRINGS = {"attention", "softmax", "softmax-separate", "zero", "v_mean"}
#: where a name is parsed (the one place a string may be compared)
PARSERS = {"check_prior_mean"}


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
        for child in ast.iter_child_nodes(node):
            visit(child, inside_parser)

    visit(tree)
    return found


def test_no_string_test_of_the_prior_mean_in_variational():
    offenders = {
        path.name: lines
        for path in sorted(VARIATIONAL.glob("*.py"))
        if (lines := _string_tests(ast.parse(path.read_text())))
    }
    assert not offenders, f"string tests of prior_mean / mean_values / v_mean (file: lines): {offenders}"


def test_the_check_finds_a_string_test():
    assert _string_tests(ast.parse("def f(s):\n    return s.prior_mean == 'zero'\n")) == [2]
    assert _string_tests(ast.parse("def f(s):\n    return 'v_mean' in s.projections\n")) == [2]
    assert _string_tests(ast.parse("def f(mean_values):\n    return mean_values is None\n")) == []
    assert _string_tests(ast.parse("def check_prior_mean(prior_mean):\n    return prior_mean in ('zero',)\n")) == []


def test_strings_build_the_modules():
    kernel = gpattn.build_attention("sgpa", 8, 2).kernel
    assert isinstance(make_prior_mean("zero", kernel), ZeroMean)
    assert isinstance(make_prior_mean("softmax", kernel), SoftmaxMean)
    mean = ZeroMean()
    assert make_prior_mean(mean, kernel) is mean and make_correlated_mean(mean) is mean
    separate = make_correlated_mean("softmax-separate")
    assert isinstance(separate, CorrelatedSoftmaxMean) and separate.projections == ("v_mean",)
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
