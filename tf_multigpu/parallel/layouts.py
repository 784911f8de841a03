"""Model-parallel placement as data: (variable-path regex, sharding spec) rules.

A spec names, per dimension of a variable, the mesh axis it is split on ("model") or "-" for
unsplit. Variable paths are Keras paths such as `alexnet/conv2/kernel`. Built-in policies:

  filter_split  every conv kernel split on output channels (filters), hidden dense kernels on
                units, biases with them: the paper's model parallelism.
  fc_only       convolutions replicated, hidden dense layers split on units. On a B x M mesh
                the convolutions run data parallel over the B groups only and redundantly
                on the M devices of each group (each computes its group's whole batch).
  conv_data_fc_model
                Krizhevsky 2014's "one weird trick": the same rules as fc_only, and the input
                batch split over `model` too (BATCH_ON_MODEL), so the convolutions run data
                parallel over all N devices (their gradients all-reduced over N); the first
                split dense layer all-gathers the batch, and the dense layers run model
                parallel over N. Mesh batch:1,model:N only: DTensor shards a tensor
                dimension over one mesh axis, so the batch cannot be split over both.

The classifier (`logits`) is split on classes where the class count divides by the model
axis (1000 for ImageNet) and replicated where it does not (10 digits on 4 devices): its rules
end in "?", which only built-in policies use, and the choice is reported in the run's log.

The first matching rule wins; variables no rule matches are replicated. A rule that matches
no variable, a spec of the wrong rank, or a split that does not divide its dimension is an
error, never a silent no-op.
"""

from __future__ import annotations

import re

from tf_multigpu.errors import UsageError

UNSPLIT = "-"
AXES = ("batch", "model")

POLICIES = {
    "filter_split": [
        (r".*conv[^/]*/kernel", "-,-,-,model"),
        (r".*conv[^/]*/bias", "model"),
        (r".*(fc|dense)[^/]*/kernel", "-,model"),
        (r".*(fc|dense)[^/]*/bias", "model"),
        (r".*logits/kernel", "-,model?"),
        (r".*logits/bias", "model?"),
    ],
    "fc_only": [
        (r".*(fc|dense)[^/]*/kernel", "-,model"),
        (r".*(fc|dense)[^/]*/bias", "model"),
        (r".*logits/kernel", "-,model?"),
        (r".*logits/bias", "model?"),
    ],
}
# Same variables as fc_only; what differs is the input, whose batch is split over `model`.
POLICIES["conv_data_fc_model"] = POLICIES["fc_only"]
BATCH_ON_MODEL = ("conv_data_fc_model",)   # layouts that shard the input batch over `model`


def parse_rules(text: str) -> list[tuple[str, str]]:
    """`REGEX=SPEC;REGEX=SPEC` (e.g. `.*conv1/kernel=-,-,-,model`) -> rules."""
    rules = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        regex, sep, spec = item.rpartition("=")
        if not sep or not regex:
            raise UsageError(f"--layout_rules item {item!r} is not REGEX=SPEC, e.g. '.*conv1/kernel=-,-,-,model'")
        try:
            re.compile(regex)
        except re.error as e:
            raise UsageError(f"--layout_rules regex {regex!r} is invalid ({e})") from None
        for axis in spec.split(","):
            if axis not in (UNSPLIT, *AXES):
                raise UsageError(f"--layout_rules spec {spec!r}: each dimension is '-', 'batch' or 'model'")
        rules.append((regex, spec))
    return rules


def policy_rules(layout: str, layout_rules: str = "") -> list[tuple[str, str]]:
    """The rules for --layout (a built-in name), or --layout_rules when given."""
    if layout_rules:
        return parse_rules(layout_rules)
    if layout not in POLICIES:
        raise UsageError(f"unknown --layout={layout!r}: choose one of {', '.join(POLICIES)}, "
                         "or give --layout_rules='REGEX=SPEC;...'")
    return POLICIES[layout]


def assign_specs(variables: dict, rules, mesh_shape: dict) -> dict:
    """{path: shape} -> {path: [axis or '-' per dim]}; checks every rule and every split."""
    used, specs = set(), {}
    for path, shape in variables.items():
        spec = [UNSPLIT] * len(shape)
        for i, (regex, text) in enumerate(rules):
            if re.fullmatch(regex, path):
                used.add(i)
                optional = text.endswith("?")
                spec = text.replace("?", "").split(",")
                if len(spec) != len(shape):
                    raise UsageError(f"layout rule {regex!r}={text!r} has rank {len(spec)} but {path} "
                                     f"has shape {list(shape)}: give one entry per dimension")
                if optional and any(a != UNSPLIT and n % mesh_shape[a] for n, a in zip(shape, spec)):
                    spec = [UNSPLIT] * len(shape)   # built-in "split if it divides" rule
                break
        for dim, (size, axis) in enumerate(zip(shape, spec)):
            if axis != UNSPLIT and size % mesh_shape[axis]:
                raise UsageError(f"{path} dimension {dim} ({size}) does not divide by the {mesh_shape[axis]} "
                                 f"devices of mesh axis '{axis}': change --mesh or the layout")
        specs[path] = spec
    unused = [regex for i, (regex, text) in enumerate(rules) if i not in used and not text.endswith("?")]
    if unused:
        raise UsageError(f"layout rule(s) {unused} match no variable of the model (variables: "
                         f"{', '.join(list(variables)[:6])}...): fix the regex")
    return specs
