"""One protocol per modelling choice (docs/derivations.md §5c, §7a): a prior mean is a module the strategies
receive, q(ũ)'s mean reaches the conditioning code through one interface, the covariance form is an object, and the
names resolve once, in the registry. The guard below counts the places in gpattn/variational/ and gpattn/attention/
that branch on which prior mean, q(ũ) mean, kernel or covariance form they hold; only the listed ones may."""

import ast
import itertools
import pathlib

import pytest
import torch

import gpattn
from gpattn.attention.registry import resolve
from gpattn.variational.means import (
    OWN_VALUES,
    AmortisedValueMean,
    CentredVariationalMean,
    CorrelatedSeparateSoftmaxMean,
    CorrelatedSoftmaxMean,
    PriorMean,
    SoftmaxMean,
    ZeroMean,
)
from gpattn.variational.sgpa import SGPAVariationalStrategy

PACKAGE = pathlib.Path(gpattn.__file__).parent
#: the packages the guard reads
GUARDED = ("variational", "attention")

# ---------------------------------------------------------------------------------------------- the guard's rule
#: the public spellings of the forms (prior means, covariance forms, sgpa-rff's g, kernel names)
FORM_STRINGS = {"attention", "softmax", "softmax-separate", "zero", "full", "diag", "query", "sequence", "cosine",
                "canonical-rbf", "exponential", "ard-rbf", "matern", "v_mean"}
#: the options and attributes that hold a form (comparing one with ``==`` / ``in`` asks which form it is)
FORM_NAMES = {"prior_mean", "covariance", "gp_input", "kernel", "mean_values", "variational_mean", "mean_module"}
#: the classes of the forms: an ``isinstance`` test against one asks which form an object is
FORM_CLASSES = {"ZeroMean", "AttentionMean", "SoftmaxMean", "CorrelatedSoftmaxMean", "CorrelatedSeparateSoftmaxMean",
                "KEPSoftmaxMean", "KEPSeparateSoftmaxMean", "AmortisedValueMean", "CentredVariationalMean", "PriorMean",
                "FullCovariance", "DiagonalCovariance", "TrainingQueryCovariance", "TrainingSequenceCovariance",
                "Kernel", "ExponentialKernel", "CanonicalRBFKernel"}
#: flags that would tell forms apart
FORM_FLAGS = {"has_gamma", "centred", "without_gram", "separate", "sequence", "joint", "amortised", "uses_gram"}
#: values a form decides: asking whether one is absent (``is None``) asks which form is there (the zero prior mean,
#: a q(ũ) centred at it, a mean basis, the Gram a covariance form or mean basis reads)
DECIDED = {"prior", "prior_mean", "update", "alpha", "inducing_values", "coefficients", "gamma", "query_gamma",
           "gram_values", "proj_values", "plan", "shift", "K", "gram", "term", "basis", "quad", "mean_module",
           "variational_mean"}


def _name(node):
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _asks_the_form(test: ast.AST) -> bool:
    """Whether a condition reads which form a prior mean, q(ũ) mean, kernel or covariance is: its name, its class,
    a flag, or whether a value it decides is absent."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                if any(_name(s) in DECIDED for s in sides):
                    return True
            elif any(isinstance(s, ast.Constant) and s.value in FORM_STRINGS for s in sides) or any(
                _name(s) in FORM_NAMES for s in sides
            ):
                return True
        if isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) > 1:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(_name(c) in FORM_CLASSES for c in classes) or (
                any(_name(c) == "str" for c in classes) and _name(node.args[0]) in FORM_NAMES
            ):
                return True
        if isinstance(node, (ast.Name, ast.Attribute)) and _name(node) in FORM_FLAGS:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "projections" and test is node:  # `if mean.projections:`
            return True
    return False


def _defaulting(node: ast.IfExp) -> bool:
    """``default if x is None else x`` (or ``x if x is not None else default``): an omitted argument's default, not a
    choice between computations."""
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name)):
        return False
    kept = node.orelse if isinstance(test.ops[0], ast.Is) else node.body
    return isinstance(kept, ast.Name) and kept.id == test.left.id


def _refusal(node: ast.If) -> bool:
    """``if <a bad input>: ... raise``: a check of an input, which chooses nothing."""
    return not node.orelse and isinstance(node.body[-1], ast.Raise)


def branch_sites(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every condition (``if``, ternary, ``while``, comprehension filter, boolean
    operand) that asks which form it holds, outside input checks (their tests and messages) and argument defaults."""
    found = []

    def visit(node, function="<module>", quiet=False):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        quiet = quiet or isinstance(node, ast.Raise) or (isinstance(node, ast.If) and _refusal(node))
        tests = []
        if isinstance(node, (ast.If, ast.While)) or (isinstance(node, ast.IfExp) and not _defaulting(node)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        elif isinstance(node, ast.BoolOp):
            tests = node.values[:-1]
        if not quiet and any(_asks_the_form(t) for t in tests):
            found.append((function, node.lineno if hasattr(node, "lineno") else tests[0].lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function, quiet)

    visit(tree)
    return found


def guarded_sites() -> set[tuple[str, str]]:
    """(file, function) of every branch site in the guarded packages."""
    return {
        (f"{package}/{path.name}", function)
        for package in GUARDED
        for path in sorted((PACKAGE / package).glob("*.py"))
        for function, _ in branch_sites(ast.parse(path.read_text()))
    }


#: the places that may branch on a form, and why (at most five): the zero algebra's two (None is the zero of a zero
#: prior mean and of a centred q(ũ), so a zero costs no operation), and sgpa-decoupled's choice of where the Gram-free
#: prior mean runs and of the points its global basis is taken at, which depend on whether the covariance or a mean
#: basis reads the Gram and whether there is a mean basis (docs/derivations.md §5b, §12)
ALLOWED_SITES = {
    ("variational/means.py", "present"),
    ("variational/means.py", "when_present"),
    ("variational/sgpa_decoupled.py", "_condition_self"),
    ("variational/sgpa_decoupled.py", "_self_prior_mean"),
    ("variational/sgpa_decoupled.py", "_condition_cross"),
}


def test_at_most_five_places_branch_on_a_form():
    assert len(ALLOWED_SITES) <= 5
    found = guarded_sites()
    assert found <= ALLOWED_SITES, f"a branch on a form (file, function): {sorted(found - ALLOWED_SITES)}"
    assert found == ALLOWED_SITES, f"a listed site is gone (shorten the list): {sorted(ALLOWED_SITES - found)}"


def _sites(source: str) -> list[str]:
    return [function for function, _ in branch_sites(ast.parse(source))]


def test_the_guard_sees_a_branch_on_a_form():
    """The rule finds a form's name, class, flag and absent value, and leaves input checks, error messages, argument
    defaults and what forms do alike."""
    assert _sites("def f(s):\n    return 1 if s.prior_mean == 'zero' else 2\n") == ["f"]
    assert _sites("def f(s):\n    if s.covariance == 'diag':\n        return 1\n    return 2\n") == ["f"]
    assert _sites("def f(s):\n    return [m for m in s.means if isinstance(m, ZeroMean)]\n") == ["f"]
    assert _sites("def f(s):\n    if s.variational_mean.centred:\n        pass\n") == ["f"]
    assert _sites("def f(c):\n    return 0 if not c.has_gamma else c.gamma\n") == ["f"]
    assert _sites("def f(alpha, K):\n    return K if alpha is None else K @ alpha\n") == ["f"]
    assert _sites("def f(mean):\n    if mean.projections:\n        return 1\n") == ["f"]
    assert _sites("def f(kernel):\n    return kernel if isinstance(kernel, str) else 1\n") == ["f"]
    # not a branch on a form: an input check and its message, an argument's default, an unrelated test
    refusal = "def f(kernel):\n    if kernel != 'cosine':\n        raise ValueError(f'{1 if kernel else 2}')\n"
    assert _sites(refusal) == []
    assert _sites("def f(gram, k):\n    gram = k() if gram is None else gram\n    return gram\n") == []
    assert _sites("def f(mask):\n    return 1 if mask is None else 2\n") == []


def test_the_guard_counts_the_forms_branches_of_the_code_before_the_objects():
    """Written the way gpattn/variational/sgpa.py tested its covariance before the objects, the guard sees them."""
    before = (
        "class C:\n"
        "    def posterior(self):\n"
        "        if self.covariance == 'diag':\n"
        "            return 1\n"
        "    def condition(self):\n"
        "        gram = k() if self.covariance == 'full' else None\n"
        "        plan = self.variational_mean.without_gram(lambda: 0)\n"
        "        K = k() if plan is None else None\n"
    )
    assert _sites(before) == ["posterior", "condition", "condition"]


def test_nothing_in_variational_imports_a_name_parser():
    """The strategies receive objects: no module of gpattn/variational/ imports the registry (or any module of
    gpattn/attention/), where names resolve."""
    offenders = {}
    for path in sorted((PACKAGE / "variational").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            targets = [module] if module else names
            if any(t and (t.startswith("gpattn.attention") or t == "gpattn.prior_means") for t in targets):
                offenders.setdefault(path.name, []).append(node.lineno)
    assert not offenders, f"gpattn/variational/ imports a name parser: {offenders}"
    assert not (PACKAGE / "prior_means.py").exists()


# ----------------------------------------------------------------------------------------------------- the protocol
def test_names_resolve_to_fresh_objects_in_the_registry():
    assert isinstance(resolve("sgpa", "prior_mean", "zero"), ZeroMean)
    assert resolve("sgpa", "prior_mean", "zero") is not resolve("sgpa", "prior_mean", "zero")
    mean = SoftmaxMean()
    assert resolve("sgpa", "prior_mean", mean) is mean and resolve("cgp", "prior_mean", mean) is mean
    separate = resolve("scgp", "prior_mean", "softmax-separate")
    assert isinstance(separate, CorrelatedSeparateSoftmaxMean) and separate.projections == OWN_VALUES == ("v_mean",)
    assert type(resolve("cgp", "prior_mean", "softmax")) is CorrelatedSoftmaxMean
    assert resolve("cgp", "prior_mean", "softmax").projections == () == resolve("cgp", "prior_mean", "zero").projections
    layer = gpattn.build_attention("scgp", 8, 2, num_inducing=3, num_inducing_keys=3)
    assert "v_mean" in layer.projections and isinstance(layer.strategy.mean_module, CorrelatedSeparateSoftmaxMean)


@pytest.mark.parametrize("name", ["sgpa", "sgpa-decoupled", "sgpa-rff", "kep-svgp", "cgp", "scgp"])
def test_every_variant_that_takes_a_mean_takes_the_one_protocol(name):
    """Every GP variant's prior mean is a PriorMean called as mean(queries, keys, values, kernel=, excluded=); the
    zero mean is a zero in each (None: its layer's mean is the GP's alone) and owns nothing."""
    torch.manual_seed(0)
    options = {"num_inducing": 3, "num_inducing_keys": 3} if name == "scgp" else {}
    layer = gpattn.build_attention(name, 8, 2, prior_mean=ZeroMean(), **options).double()
    assert isinstance(layer.strategy.mean_module, PriorMean) and isinstance(layer.strategy.mean_module, ZeroMean)
    assert not any(p.endswith("_mean") for p in layer.projections)  # the zero owns no projection
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with gpattn.deterministic():
        assert torch.isfinite(layer(x)).all()
    assert ZeroMean()(x, x, x, kernel=None) is None
    default = gpattn.build_attention(name, 8, 2, **options)
    assert isinstance(default.strategy.mean_module, PriorMean)


def test_a_strategy_given_modules_equals_one_given_the_name():
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa", 8, 2, prior_mean="zero").double()
    s = layer.strategy
    keys, values = torch.randn(2, 2, 5, 4, dtype=torch.float64), torch.randn(2, 2, 5, 4, dtype=torch.float64)
    given = SGPAVariationalStrategy(
        s.kernel, s.variational_distribution, jitter=s.jitter, covariance=s.covariance, mean_module=ZeroMean(),
        variational_mean=AmortisedValueMean(),
    )
    for mask in (None, torch.ones(5, 5, dtype=torch.bool).triu(1)[None, None]):
        a, b = s.condition(keys, values, mask), given.condition(keys, values, mask)
        assert torch.equal(a.mean, b.mean) and torch.equal(a.kl_divergence(), b.kl_divergence())
    assert isinstance(gpattn.build_attention("sgpa", 8, 2).strategy.variational_mean, CentredVariationalMean)


def test_q_u_s_mean_reaches_the_conditioning_code_through_one_interface():
    """A q(ũ) mean is asked one thing, its coefficients: the values (amortised, Chen & Li's) or None (centred)."""
    v = torch.randn(2, 2, 5, 4)
    assert AmortisedValueMean().inducing_values(v) is v and CentredVariationalMean().inducing_values(v) is None
    for q_mean in (AmortisedValueMean, CentredVariationalMean):
        assert [m for m in vars(q_mean) if not m.startswith("__")] == ["inducing_values"]
    assert ZeroMean.variational_mean is AmortisedValueMean and SoftmaxMean.variational_mean is CentredVariationalMean


def test_the_decoupled_strategy_asks_its_q_mean_object_for_the_mean_basis():
    """sgpa-decoupled given the q(ũ)-mean objects equals one built from the name, on every conditioning path (self,
    causal, general per-query mask, cross); the object alone decides the mean basis γ (a centred q(ũ) leaves no
    γ-part, whatever the prior mean)."""
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
            covariance=s.covariance, mean_module=resolve("sgpa", "prior_mean", prior_mean), variational_mean=q_mean(),
        )
        paired = type(s.variational_mean) is q_mean  # the pairing the name builds
        for call in calls:
            a, b = s.condition(q, v, kg, **call), given.condition(q, v, kg, **call)
            assert (b.gamma is not None) == (q_mean is AmortisedValueMean)
            assert [type(t).__name__ for t in b.added_loss_terms()] == (
                ["SequenceKL", "GlobalKL"] if q_mean is AmortisedValueMean else ["GlobalKL"]
            )
            if paired:
                assert type(a) is type(b) and torch.equal(a.mean, b.mean)
                assert torch.equal(a.kl_divergence(), b.kl_divergence())


def test_the_moved_parsers_say_where_they_went_and_what_they_say_works():
    import gpattn.variational.kep_svgp as kep
    import gpattn.variational.means as means
    from gpattn.attention.registry import CHOICES, resolve

    for name in ("PRIOR_MEANS", "check_prior_mean"):  # what gpattn 0.2.0 exported (tests/test_release_compat.py)
        with pytest.raises(AttributeError, match=rf"means\.{name} moved to gpattn\.attention\.registry\."):
            getattr(means, name)
    assert set(CHOICES["sgpa"]["prior_mean"]) == {"attention", "zero"}  # 0.2.0's PRIOR_MEANS
    assert isinstance(resolve("sgpa", "prior_mean", "zero"), means.ZeroMean)
    with pytest.raises(ValueError, match="prior_mean must be one of"):
        resolve("sgpa", "prior_mean", "nothing")
    for module, name in ((means, "make_prior_mean"), (means, "CGP_PRIOR_MEANS"), (kep, "make_kep_mean")):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'$"):  # no release had them
            getattr(module, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = means.nothing
