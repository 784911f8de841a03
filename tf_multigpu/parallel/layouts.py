"""Model-parallel placement as data: built-in policies by layer type, or user rules by path.

A spec names, per dimension of a variable, the mesh axis it is split on ("model") or "-" for
unsplit. Built-in policies select layers by what they ARE (their Keras class), never by what
they happen to be called:

  filter_split  every Conv2D kernel split on output channels (filters) and every Dense on
                units, biases with them: the paper's model parallelism. SeparableConv2D's
                pointwise kernels are split too, by the placement plan (`placement.py`): on
                their filters where the input is whole, on their inputs where it is split.
  fc_only       convolutions replicated, Dense layers split on units. On a B x M mesh the
                convolutions run data parallel over the B groups only and redundantly on the
                M devices of each group (each computes its group's whole batch).
  conv_data_fc_model
                Krizhevsky 2014's "one weird trick": the same variables as fc_only, and the input
                batch split over `model` too (BATCH_ON_MODEL), so the convolutions run data
                parallel over all N devices (their gradients all-reduced over N); the first
                split Dense layer all-gathers the batch, and the Dense layers run model
                parallel over N. Mesh batch:1,model:N only: DTensor shards a tensor
                dimension over one mesh axis, so the batch cannot be split over both.

The classifier (the Dense layer producing the logits) is split on classes where the class
count divides by the model axis (1000 for ImageNet) and replicated where it does not (10
digits on 4 devices): its rules end in "?", which only built-in policies use.

Variables of layers that act per channel (BatchNormalization, depthwise and grouped
convolutions) follow the layout of their input: the placement plan (`placement.py`) splits
them where their input's channels are split. User rules (`--layout_rules`, path regexes) name
variable paths such as `alexnet/conv2/kernel`; the first matching rule wins; variables no rule
matches are replicated. Overrides (`--layout_overrides`, the same syntax) amend a built-in
policy instead: the variables they match are placed by them, the rest by the policy (e.g.
one layer whose filters do not divide kept whole); variables that follow a split input
still follow it. A rule that matches no variable, a spec of the wrong rank, or a split
that does not divide its dimension is an error, never a silent no-op.
"""

from __future__ import annotations

import re

from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.mesh_spec import AXES

UNSPLIT = "-"

# policy -> the Keras layer classes (names in keras.layers) whose kernels it splits on outputs
SPLIT_TYPES = {
    "filter_split": ("Conv2D", "Dense"),
    "fc_only": ("Dense",),
    "conv_data_fc_model": ("Dense",),   # what differs from fc_only is the input, split over `model`
}
POLICIES = tuple(SPLIT_TYPES)
BATCH_ON_MODEL = ("conv_data_fc_model",)   # layouts that shard the input batch over `model`


def parse_rules(text: str, flag: str = "--layout_rules") -> list[tuple[str, str]]:
    """`REGEX=SPEC;REGEX=SPEC` (e.g. `.*conv1/kernel=-,-,-,model`) -> rules (the config parses
    --layout_rules and --layout_overrides, named by `flag` in errors, with it when it is built)."""
    rules = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        regex, sep, spec = item.rpartition("=")
        if not sep or not regex:
            raise UsageError(f"{flag} item {item!r} is not REGEX=SPEC, e.g. '.*conv1/kernel=-,-,-,model'")
        try:
            re.compile(regex)
        except re.error as e:
            raise UsageError(f"{flag} regex {regex!r} is invalid ({e}): give a Python regular expression "
                             "over variable paths, e.g. '.*conv1/kernel=-,-,-,model'") from None
        for axis in spec.split(","):
            if axis not in (UNSPLIT, *AXES):
                raise UsageError(f"{flag} spec {spec!r}: each dimension is '-', 'batch' or 'model'")
        rules.append((regex, spec))
    return rules


def whole_rule(path: str, rank: int) -> tuple[str, str]:
    """The --layout_overrides rule that keeps one variable (and so its layer) whole."""
    return re.escape(path), ",".join([UNSPLIT] * rank)


def keep_whole(path: str, rank: int) -> str:
    """The fix that keeps one variable (and so its layer) whole under a built-in layout."""
    return "keep it whole: --layout_overrides='{}={}'".format(*whole_rule(path, rank))


class NotDividing(UsageError):
    """A built-in layout would split a layer that does not divide by the model axis; the fix
    keeps `path` (rank `rank`) whole. `make_plan` collects them all into one refusal."""

    def __init__(self, message: str, path: str, rank: int, what: str):
        super().__init__(message)
        self.path, self.rank, self.what = path, rank, what   # what: "stem/kernel dimension 3 (5)"


def assign_specs(variables: dict, rules, mesh_shape: dict, hint_whole: bool = False,
                 flag: str = "layout rule") -> dict:
    """{path: shape} -> {path: [axis or '-' per dim]}; checks every rule and every split.
    `hint_whole`: a split that does not divide names `keep_whole` as a fix (built-in rules)."""
    used, specs = set(), {}
    for path, shape in variables.items():
        spec = [UNSPLIT] * len(shape)
        for i, (regex, text) in enumerate(rules):
            if re.fullmatch(regex, path):
                used.add(i)
                optional = text.endswith("?")
                spec = text.replace("?", "").split(",")
                if len(spec) != len(shape):
                    raise UsageError(f"{flag} {regex!r}={text!r} has rank {len(spec)} but {path} "
                                     f"has shape {list(shape)}: give one entry per dimension")
                if optional and any(a != UNSPLIT and n % mesh_shape[a] for n, a in zip(shape, spec)):
                    spec = [UNSPLIT] * len(shape)   # built-in "split if it divides" rule
                break
        for dim, (size, axis) in enumerate(zip(shape, spec)):
            if axis != UNSPLIT and size % mesh_shape[axis]:
                what = f"{path} dimension {dim} ({size})"
                message = f"{what} does not divide by the {mesh_shape[axis]} devices of mesh axis '{axis}': "
                if hint_whole:
                    raise NotDividing(message + f"change --mesh or the layout, or {keep_whole(path, len(shape))}",
                                      path, len(shape), what)
                raise UsageError(message + "change --mesh or the layout")
        specs[path] = spec
    unused = [regex for i, (regex, text) in enumerate(rules) if i not in used and not text.endswith("?")]
    if unused:
        raise UsageError(f"{flag}(s) {unused} match no variable of the model (variables: "
                         f"{', '.join(list(variables)[:6])}...): fix the regex")
    return specs
