"""The placement plan on models we did not write: decisions by layer type, layouts through
branches and merges, nested models, follower variables, and the errors a user gets.

Plans are computed from the plain Keras model (no devices), so these run in seconds."""

import os
import re

import keras
import numpy as np
import pytest

from tests import user_models
from tests.conftest import REPO
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.layouts import parse_rules
from tf_multigpu.parallel.memory import bytes_per_device, saved_elems, transient_elems
from tf_multigpu.parallel.placement import CHANNELS, MAX_REFUSED, WHOLE, make_plan

L = keras.layers


@pytest.fixture(scope="module")
def resnet50():
    return user_models.resnet50((32, 32, 3), 10)


@pytest.fixture(scope="module")
def mobilenet_v2():
    return user_models.mobilenet_v2((32, 32, 3), 10)


def _impls(plan):
    out = {}
    for layer in plan.layers:
        out.setdefault(layer.node.cls.__name__, set()).add(layer.impl)
    return out


def test_resnet50_filter_split_splits_every_conv_and_keeps_bn_on_the_channels(resnet50):
    plan = make_plan(resnet50, "filter_split", [], {"batch": 1, "model": 2})
    impls = _impls(plan)
    assert impls["Conv2D"] == {"SplitConv2D"}
    assert impls["BatchNormalization"] == {""} and impls["Add"] == {""}   # stock, on split channels
    assert impls["MaxPooling2D"] == {"SlicePool2D"}
    for layer in plan.layers:
        if layer.node.cls is L.BatchNormalization:   # its statistics follow the split channels
            assert layer.in_layouts == (CHANNELS,) and layer.out_layout == CHANNELS
            for path in layer.node.weights:
                assert plan.specs[path] == ["model"], path
    # the residual merges meet operands of one layout: no relayout, no communication
    adds = [p for p in plan.layers if p.node.cls is L.Add]
    assert len(adds) == 16 and all(p.in_layouts == (CHANNELS, CHANNELS) and not p.collectives for p in adds)
    # 10 classes split 2 ways: the logits are gathered for the loss
    assert plan.output_layout == CHANNELS and plan.collectives[-1].layer == "loss"
    # the stem conv sees the image (whole): nothing upstream has weights, no input gradient
    stem = plan["conv1_conv"]
    assert stem.in_layouts == (WHOLE,) and not stem.needs_input_grad and not stem.collectives


def test_resnet50_fc_only_splits_only_the_classifier(resnet50):
    plan = make_plan(resnet50, "fc_only", [], {"batch": 2, "model": 2})
    assert [p for p, s in plan.specs.items() if "model" in s] == ["predictions/kernel", "predictions/bias"]
    assert _impls(plan)["Conv2D"] == {""}


def test_mobilenet_v2_depthwise_convolutions_follow_their_split_input(mobilenet_v2):
    plan = make_plan(mobilenet_v2, "filter_split", [], {"batch": 1, "model": 4})
    depthwise = [p for p in plan.layers if p.node.cls is L.DepthwiseConv2D]
    assert len(depthwise) == 17
    for layer in depthwise:
        assert layer.impl == "SplitDepthwiseConv2D" and layer.out_layout == CHANNELS and not layer.collectives
        kernel = layer.node.weight("kernel")
        assert plan.specs[kernel] == ["-", "-", "model", "-"]
    # 10 classes do not split 4 ways: the classifier is replicated and gathers its input
    assert plan["predictions"].impl == "GatherDense" and plan.output_layout == WHOLE
    memory = bytes_per_device(plan, 64)
    single = bytes_per_device(make_plan(mobilenet_v2, "", [], {"batch": 1, "model": 1}), 64)
    assert memory["parameters"] < single["parameters"] / 3


def test_grouped_and_separable_convolutions_on_split_channels_are_chosen_by_the_plan():
    """A grouped Conv2D keeps whole groups on each device (no communication); a separable one
    convolves its channels locally and sums the pointwise products in one all-reduce."""
    model = keras.Sequential([keras.Input((16, 16, 3)), L.Conv2D(8, 3, name="c1"),
                              L.Conv2D(8, 3, groups=2, name="grouped"), L.SeparableConv2D(8, 3, name="sep"),
                              L.GlobalAveragePooling2D(), L.Dense(10, name="logits")], name="m")
    plan = make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    grouped, sep = plan["grouped"], plan["sep"]
    assert grouped.impl == "SplitGroupedConv2D" and grouped.in_layouts == (CHANNELS,)
    assert grouped.out_layout == CHANNELS and not grouped.collectives
    assert plan.specs["m/grouped/kernel"] == ["-", "-", "-", "model"] and plan.specs["m/grouped/bias"] == ["model"]
    assert sep.impl == "SplitSeparableConv2D" and sep.out_layout == WHOLE
    assert [(c.op, c.axis, c.phase) for c in sep.collectives] == [("all_reduce", "model", "forward")]
    assert plan.specs["m/sep/depthwise_kernel"] == plan.specs["m/sep/pointwise_kernel"] == ["-", "-", "model", "-"]
    # on a whole input (nothing split upstream) both run as they are, replicated
    whole = make_plan(model, "filter_split", [(".*logits/kernel", "-,model"), (".*logits/bias", "model")],
                      {"batch": 1, "model": 2})
    # (a grouped one as window_sum: TensorFlow's CPU kernels have no gradient for it on a mesh)
    assert whole["grouped"].impl == "WholeGroupedConv2D" and whole["sep"].impl == "SplitSeparableConv2D"
    assert whole["grouped"].out_layout == WHOLE and not whole["grouped"].collectives and not whole["sep"].collectives
    odd = keras.Sequential([keras.Input((16, 16, 3)), L.Conv2D(8, 3, name="c1"),
                            L.Conv2D(8, 3, groups=2, name="grouped")], name="odd")
    with pytest.raises(UsageError, match=r"layer grouped has 2 groups, which do not divide by the 4 devices .*"
                                         r"keep it whole: --layout_overrides='odd/grouped/kernel=-,-,-,-'$"):
        make_plan(odd, "filter_split", [], {"batch": 1, "model": 4})
    # kept whole as the refusal says: its split input is gathered, and it runs whole
    kept = make_plan(odd, "filter_split", [], {"batch": 1, "model": 4},
                     overrides=parse_rules("odd/grouped/kernel=-,-,-,-"))["grouped"]
    assert kept.impl == "GatherWholeGroupedConv2D" and kept.in_layouts == (CHANNELS,) and kept.out_layout == WHOLE
    assert [(c.op, c.axis, c.phase) for c in kept.collectives][:1] == [("all_gather", "model", "forward")]


def test_filter_split_splits_separable_convolutions_on_filters_and_on_channels_in_turn():
    """filter_split splits every SeparableConv2D: on a whole input its pointwise kernel on
    filters (output split; backward, the depthwise output's gradient all-reduced), on split
    channels on its inputs (output whole; forward, the pointwise partial sums all-reduced), so
    separable convolutions alternate with no gather between them. Every pointwise kernel is
    split. A rule splitting a pointwise kernel on filters after split channels
    gathers its input first."""
    model = user_models.separable_convnet((16, 16, 3), 10)
    plan = make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    row, column = "SplitSeparableConv2D", "FilterSplitSeparableConv2D"
    expected = {"sep_stem": (column, WHOLE, CHANNELS), "sep_row": (row, CHANNELS, WHOLE),
                "sep_column": (column, WHOLE, CHANNELS), "sep_row2": (row, CHANNELS, WHOLE),
                "sep_row3": (row, CHANNELS, WHOLE), "sep_strided": (column, WHOLE, CHANNELS)}
    for name, (impl, x, y) in expected.items():
        assert (plan[name].impl, plan[name].in_layouts[0], plan[name].out_layout) == (impl, x, y), name
    spec = plan.specs
    assert spec["sep_stem/pointwise_kernel"] == ["-", "-", "-", "model"] and spec["sep_stem/bias"] == ["model"]
    assert spec["sep_stem/depthwise_kernel"] == ["-"] * 4   # the depthwise part runs whole
    assert spec["sep_row/pointwise_kernel"] == spec["sep_row/depthwise_kernel"] == ["-", "-", "model", "-"]
    assert spec["sep_row3/bias"] == ["-"]   # added to the whole output
    # The stem computes no input gradient, but its (whole) depthwise kernel's gradient needs
    # the depthwise output's, summed over the filters: [16, 16, 3]. The strided one's depthwise
    # output has a multiplier of 2: [7, 7, 16 * 2].
    comm = {n: [(c.op, c.phase, c.elems_per_example) for c in plan[n].collectives] for n in expected}
    assert comm == {"sep_stem": [("all_reduce", "backward", 16 * 16 * 3)],
                    "sep_row": [("all_reduce", "forward", 16 * 16 * 8)],
                    "sep_column": [("all_reduce", "backward", 16 * 16 * 8)],
                    "sep_row2": [("all_reduce", "forward", 16 * 16 * 8)],
                    "sep_row3": [("all_reduce", "forward", 16 * 16 * 16)],
                    "sep_strided": [("all_reduce", "backward", 7 * 7 * 32)]}
    for name in expected:   # every pointwise kernel split in two
        path = f"{name}/pointwise_kernel"
        assert plan.local_elems(path, model.get_layer(name).pointwise_kernel.shape) * 2 == int(
            np.prod(model.get_layer(name).pointwise_kernel.shape))
    # the depthwise output is kept for the pointwise kernel's gradient: split on channels in
    # the row-split one, whole in the column-split one
    assert saved_elems(plan)["sep_row"] == 16 * 16 * 8 + 16 * 16 * 8 // 2
    assert saved_elems(plan)["sep_column"] == 16 * 16 * 8 // 2 + 16 * 16 * 8

    rules = [(".*logits/kernel", "-,model"), (".*sep_stem/pointwise_kernel", "-,-,-,model"),
             (".*sep_row/pointwise_kernel", "-,-,-,model")]
    ruled = make_plan(model, "filter_split", rules, {"batch": 1, "model": 2})
    assert ruled["sep_row"].impl == column and ruled["sep_row"].gathers and ruled["sep_row"].new_gather
    assert [(c.op, c.phase, c.elems_per_example) for c in ruled["sep_row"].collectives] == [
        ("all_gather", "forward", 16 * 16 * 8), ("all_reduce", "backward", 16 * 16 * 8)]
    assert ruled["sep_column"].impl == row and ruled["sep_column"].out_layout == WHOLE
    with pytest.raises(UsageError, match=r"^--layout=filter_split can split none of separable_convnet's layers over "
                                         r"the 3 devices of mesh axis 'model' \(sep_stem/pointwise_kernel dimension 3 "
                                         r"\(8\); .*; and 3 more\): change --mesh or the layout$"):
        make_plan(model, "filter_split", [], {"batch": 1, "model": 3})


def test_xception_holds_half_its_parameters_per_device_on_filter_split():
    """Xception's 34 separable convolutions: with the pointwise kernels of those on whole
    inputs replicated, one device of model 1x2 held 0.79 of the parameters (0.68 on 1x4)."""
    model = keras.applications.Xception(weights=None, input_shape=(71, 71, 3), classes=1000)
    single = bytes_per_device(make_plan(model, "", [], {"batch": 1, "model": 1}), 8)["parameters"]
    for m, share in ((2, 0.51), (4, 0.26)):
        plan = make_plan(model, "filter_split", [], {"batch": 1, "model": m})
        assert bytes_per_device(plan, 8)["parameters"] / single <= share
        impls = [p.impl for p in plan.layers if p.node.cls is L.SeparableConv2D]
        assert impls.count("FilterSplitSeparableConv2D") == 13 and impls.count("SplitSeparableConv2D") == 21


def test_layout_overrides_amend_the_policy_where_a_layer_does_not_divide():
    """A layer whose filters do not divide by the model axis (NASNetMobile's 11-filter stem)
    used to leave a choice between another mesh and rules for every variable (--layout_rules
    replaces the policy). The refusal now names the override that keeps that layer whole;
    with it the policy places the rest, and a separable convolution the override names is not
    split on filters by the policy."""
    model = user_models.odd_stem_convnet((16, 16, 3), 10)
    mesh = {"batch": 1, "model": 2}
    with pytest.raises(UsageError, match=r"^stem/kernel dimension 3 \(5\) does not divide by the 2 devices of mesh "
                                         r"axis 'model': change --mesh or the layout, or keep it whole: "
                                         r"--layout_overrides='stem/kernel=-,-,-,-'$"):
        make_plan(model, "filter_split", [], mesh)
    plan = make_plan(model, "filter_split", [], mesh, overrides=parse_rules(".*stem/kernel=-,-,-,-"))
    assert plan.layout == "filter_split"
    assert plan["stem"].impl == "" and plan["stem"].out_layout == WHOLE
    assert plan.specs["stem/kernel"] == ["-"] * 4 and plan.specs["stem/bias"] == ["-"]   # the bias with its kernel
    assert plan["sep"].impl == "FilterSplitSeparableConv2D" and plan["conv"].impl == "SplitConv2D"
    kept = make_plan(model, "filter_split", [], mesh,
                     overrides=parse_rules(".*stem/kernel=-,-,-,-;.*sep/pointwise_kernel=-,-,-,-"))
    assert kept["sep"].impl == "SplitSeparableConv2D" and kept["sep"].out_layout == WHOLE   # replicated
    assert kept.specs["sep/pointwise_kernel"] == ["-"] * 4 and not kept["sep"].collectives
    bias = make_plan(model, "filter_split", [], mesh, overrides=parse_rules(".*stem/kernel=-,-,-,-;.*conv/bias=-"))
    assert bias.specs["conv/kernel"] == ["-", "-", "-", "model"] and bias.specs["conv/bias"] == ["-"]
    with pytest.raises(UsageError, match=r"^--layout_overrides rule\(s\) \['.\*stem9/kernel'\] match no variable"):
        make_plan(model, "filter_split", [], mesh, overrides=parse_rules(".*stem/kernel=-,-,-,-;.*stem9/kernel=-"))
    with pytest.raises(UsageError, match=r"^--layout_overrides rule '.\*stem/kernel'='-' has rank 1"):
        make_plan(model, "filter_split", [], mesh, overrides=parse_rules(".*stem/kernel=-"))
    # From a review: a separable's bias override is kept (it was overwritten), an override on a
    # variable that follows split channels is refused (it was ignored), and splits DTensor
    # could not run are refused by the plan (they failed inside DTensor's SPMD expansion).
    whole_bias = make_plan(model, "filter_split", [], mesh, overrides=parse_rules(".*stem/kernel=-,-,-,-;.*sep/bias=-"))
    assert whole_bias["sep"].impl == "FilterSplitSeparableConv2D" and whole_bias.specs["sep/bias"] == ["-"]
    with pytest.raises(UsageError, match=r"^--layout_overrides places sep_bn/gamma as -, but it follows its layer's "
                                         r"input, whose channels are split: it is model there; drop that override"):
        make_plan(model, "filter_split", [], mesh, overrides=parse_rules(".*stem/kernel=-,-,-,-;.*sep_bn/gamma=-"))
    with pytest.raises(UsageError, match=r"^layer sep_column \(SeparableConv2D\) splits its pointwise kernel on "
                                         r"filters, which runs its depthwise part whole on every device, but a rule "
                                         r"splits sep_column/depthwise_kernel on 'model': keep that variable whole"):
        make_plan(user_models.separable_convnet((16, 16, 3), 10), "filter_split", [], mesh,
                  overrides=parse_rules(".*sep_column/depthwise_kernel=-,-,model,-"))
    with pytest.raises(UsageError, match=r"^layer sep_column \(SeparableConv2D\) receives activations not split on "
                                         r"channels, but a rule splits sep_column/pointwise_kernel on 'model'"):
        make_plan(user_models.separable_convnet((16, 16, 3), 10), "filter_split", [], mesh,
                  overrides=parse_rules(".*sep_column/pointwise_kernel=-,-,model,-"))
    with pytest.raises(UsageError, match=r"^layer sep_bn \(BatchNormalization\) has no split-aware version, but a "
                                         r"rule splits sep_bn/gamma on 'model'"):
        make_plan(model, "filter_split", [], mesh,
                  overrides=parse_rules(".*stem/kernel=-,-,-,-;.*sep/pointwise_kernel=-,-,-,-;.*sep_bn/gamma=model"))
    # conv_data_fc_model: a separable a rule splits on filters gathers the row-split batch first
    rows = make_plan(model, "conv_data_fc_model", [], mesh, True,
                     overrides=parse_rules(".*sep/pointwise_kernel=-,-,-,model;.*sep/bias=model"))
    assert rows["sep"].impl == "FilterSplitSeparableConv2D" and rows["sep"].in_layouts == ("rows",)
    assert rows["sep"].gathers and rows["sep"].collectives[0].op == "all_gather"


def test_every_layer_that_does_not_divide_is_named_in_one_refusal():
    """A model with several layers the model axis does not divide was refused one layer a run
    (NASNetMobile took ten runs). Each kind (a Conv2D's filters, a separable's pointwise
    filters on a whole input, a grouped conv's groups on split channels) is found only once
    the one before it is kept whole; the one refusal names all three, and its fix plans."""
    L = keras.layers
    x = inputs = keras.Input((16, 16, 3))
    x = L.Conv2D(5, 3, padding="same", name="stem")(x)
    x = L.SeparableConv2D(6, 3, padding="same", name="sep")(x)   # split on filters only if stem is whole
    x = L.Conv2D(8, 3, padding="same", name="conv")(x)
    x = L.Conv2D(8, 3, padding="same", groups=2, name="grouped")(x)   # on split channels only if sep is whole
    model = keras.Model(inputs, L.Dense(10, name="logits")(L.GlobalAveragePooling2D(name="gap")(x)), name="odd3")
    mesh = {"batch": 1, "model": 4}
    fix = "stem/kernel=-,-,-,-;sep/pointwise_kernel=-,-,-,-;grouped/kernel=-,-,-,-"
    with pytest.raises(UsageError, match="^" + re.escape(
            "3 layers do not divide by the 4 devices of mesh axis 'model' (stem/kernel dimension 3 (5); "
            "sep/pointwise_kernel dimension 3 (6); layer grouped's 2 groups): change --mesh or the layout, or "
            f"keep them whole: --layout_overrides='{fix}'") + "$"):
        make_plan(model, "filter_split", [], mesh)
    plan = make_plan(model, "filter_split", [], mesh, overrides=parse_rules(fix, "--layout_overrides"))
    assert [plan[n].impl for n in ("stem", "sep", "conv", "grouped")] == [
        "", "SplitSeparableConv2D", "SplitConv2D", "GatherWholeGroupedConv2D"]
    assert [plan.specs[f"{n}/kernel"][-1] for n in ("stem", "conv", "grouped")] == ["-", "model", "-"]
    # the value offered replaces the user's --layout_overrides, so it carries theirs
    mine = "sep/pointwise_kernel=-,-,-,-;grouped/kernel=-,-,-,-"
    with pytest.raises(UsageError, match="^" + re.escape(
            "1 layer does not divide by the 4 devices of mesh axis 'model' (stem/kernel dimension 3 (5)): change "
            f"--mesh or the layout, or keep it whole: --layout_overrides='{mine};stem/kernel=-,-,-,-'") + "$"):
        make_plan(model, "filter_split", [], mesh, overrides=parse_rules(mine, "--layout_overrides"))
    # a layout that can split nothing says so, not "keep them all whole"
    with pytest.raises(UsageError, match=r"^--layout=filter_split can split none of odd3's layers over the 3 devices "
                                         r"of mesh axis 'model' \(stem/kernel dimension 3 \(5\); conv/kernel "
                                         r"dimension 3 \(8\)\): change --mesh or the layout$"):
        make_plan(model, "filter_split", [], {"batch": 1, "model": 3}, overrides=parse_rules(
            "sep/pointwise_kernel=-,-,-,-"))


def test_a_refusal_offers_no_fix_that_fails():
    """One layer alone keeps the one-layer refusal. Where the plan with the refused layers
    kept whole fails on (here: the user's override of the next layer needs the stem's split
    channels), that error is named, not a --layout_overrides value that cannot work; and a
    model where most layers do not divide stops after MAX_REFUSED plans and says change the
    mesh (each refusal costs a plan: hundreds of NASNet's on model:3)."""
    L = keras.layers

    def stem_conv(stem):
        x = inputs = keras.Input((16, 16, 3))
        x = L.Conv2D(8, 3, name="conv")(L.Conv2D(stem, 3, name="stem")(x))
        return keras.Model(inputs, L.Dense(10, name="logits")(L.GlobalAveragePooling2D()(x)), name="m")

    mesh = {"batch": 1, "model": 2}
    with pytest.raises(UsageError, match=r"^stem/kernel dimension 3 \(5\) does not divide .* --layout_overrides="
                                         r"'stem/kernel=-,-,-,-'$"):
        make_plan(stem_conv(5), "filter_split", [], mesh)
    mine = parse_rules("conv/kernel=-,-,model,-", "--layout_overrides")
    plan = make_plan(stem_conv(8), "filter_split", [], mesh, overrides=mine)   # the override on split channels
    assert plan.specs["conv/kernel"] == ["-", "-", "model", "-"]
    with pytest.raises(UsageError, match="^" + re.escape(
            "1 layer does not divide by the 2 devices of mesh axis 'model' (stem/kernel dimension 3 (5)), and with it "
            "kept whole the plan fails: conv/kernel dimension 2 (5) does not divide by the 2 devices") + ".*"):
        make_plan(stem_conv(5), "filter_split", [], mesh, overrides=mine)
    x = inputs = keras.Input((8, 8, 3))
    for i in range(MAX_REFUSED + 4):
        x = L.Conv2D(5, 1, name=f"c{i}")(x)
    fives = keras.Model(inputs, L.Dense(10, name="logits")(L.GlobalAveragePooling2D()(x)), name="fives")
    with pytest.raises(UsageError, match="^" + re.escape(
            f"at least {MAX_REFUSED} layers do not divide by the 2 devices of mesh axis 'model' (c0/kernel dimension 3 "
            f"(5); c1/kernel dimension 3 (5); c2/kernel dimension 3 (5); and {MAX_REFUSED - 3} more): change --mesh or "
            "the layout") + "$"):
        make_plan(fives, "filter_split", [], mesh)


def test_nasnet_mobile_is_planned_with_the_one_refusals_fix():
    """keras.applications.NASNetMobile: ten layers of its first reduction cell have 11
    filters. The refusal names all ten with short regexes that each match one variable; with
    them, the rest of the model (674 variables) is split."""
    model = keras.applications.NASNetMobile(weights=None, input_shape=(32, 32, 3), classes=10)
    with pytest.raises(UsageError) as refusal:
        make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    message = str(refusal.value)
    assert message.startswith("10 layers do not divide by the 2 devices of mesh axis 'model' "
                              "(reduction_conv_1_stem_1/kernel dimension 3 (11); ") and "\n" not in message
    rules = parse_rules(message.split("--layout_overrides='")[1].rstrip("'"), "--layout_overrides")
    paths = [v.path for v in model.weights]
    assert [sum(bool(re.fullmatch(regex, p)) for p in paths) for regex, _ in rules] == [1] * 10
    plan = make_plan(model, "filter_split", [], {"batch": 1, "model": 2}, overrides=rules)
    assert sum("model" in spec for spec in plan.specs.values()) == 674


def test_user_layout_rules_replace_the_policy():
    """--layout_rules: only what the rules name is split, and the plan follows from it."""
    model = user_models.renamed_convnet((16, 16, 3), 10)
    rules = parse_rules(".*iota/kernel=-,model;.*iota/bias=model")
    plan = make_plan(model, "filter_split", rules, {"batch": 1, "model": 2})
    assert plan.layout == "rules"
    assert {p: s for p, s in plan.specs.items() if "model" in s} == {"iota/kernel": ["-", "model"],
                                                                      "iota/bias": ["model"]}
    assert plan["alpha"].impl == "" and plan["iota"].impl == "GatherDense" and plan["iota"].out_layout == CHANNELS
    whole = make_plan(model, "", [], {"batch": 1, "model": 1})
    assert bytes_per_device(plan, 8)["parameters"] < bytes_per_device(whole, 8)["parameters"]


def test_sharded_optimizer_state_halves_the_momentum_of_a_hybrid_pair_of_groups(resnet50):
    """--shard_optimizer_state: each slot takes `batch` on its first unsplit dimension that
    divides (a bias split on `model` keeps its variable's spec), the memory estimate counts
    what the slots then hold, and without a batch axis nothing changes."""
    mesh = {"batch": 2, "model": 2}
    plan = make_plan(resnet50, "filter_split", [], mesh, shard_slots=True)
    assert plan.slot_spec("conv2_block1_1_conv/kernel", (1, 1, 64, 64)) == ("-", "-", "batch", "model")
    assert plan.slot_spec("conv1_conv/kernel", (7, 7, 3, 64)) == ("-", "-", "-", "model")   # none divides
    assert plan.slot_spec("conv1_conv/bias", (64,)) == ("model",)
    assert plan.slot_spec("predictions/kernel", (2048, 10)) == ("batch", "model")
    sharded, plain = bytes_per_device(plan, 64), bytes_per_device(make_plan(resnet50, "filter_split", [], mesh), 64)
    assert 0.5 <= sharded["optimizer_slots"] / plain["optimizer_slots"] < 0.51
    assert sharded["parameters"] == plain["parameters"]
    assert sharded["update"] == sharded["optimizer_slots"] * 2 + sharded["gradients"]
    one_group = make_plan(resnet50, "filter_split", [], {"batch": 1, "model": 4}, shard_slots=True)
    assert not one_group.shard_slots
    assert one_group.slot_spec("conv2_block1_1_conv/kernel", (1, 1, 64, 64)) == ("-", "-", "-", "model")


def _decisions(model, layout, mesh):
    """What the plan decides for each layer but the input, by name (the pooling before
    `predictions` as "pool": Keras numbers the names it makes up), and the output's layout."""
    plan = make_plan(model, layout, [], mesh)
    pool = plan["predictions"].node.inputs[0]
    return {"pool" if p.name == pool else p.name:
            (p.node.cls, p.impl, p.in_layouts, p.out_layout, p.gathers, p.kernel_split,
             tuple((c.op, c.axis, c.phase) for c in p.collectives)) for p in plan.layers[1:]}, plan.output_layout


@pytest.mark.parametrize("cut, whole", [("resnet50_first_blocks", "resnet50"),
                                        ("mobilenet_v2_first_blocks", "mobilenet_v2")])
@pytest.mark.parametrize("num_classes", [10, 1000])
def test_the_first_blocks_of_the_slow_tests_are_placed_like_the_whole_model(cut, whole, num_classes):
    """test_parity.py, test_profiling.py and test_model_parallel.py run ResNet-50 and MobileNetV2
    cut after their first blocks to save time: on every mesh they use, each layer of the cut
    model is placed as the whole model's layer of the same name (implementation, layouts,
    gathers, kernel split, collectives), and every decision the whole model's plan makes occurs
    in the cut one, so the checks there run every kind of placement the whole model has."""
    small = getattr(user_models, cut)((32, 32, 3), num_classes)
    large = getattr(user_models, whole)((32, 32, 3), num_classes)
    for layout in ("filter_split", "fc_only"):
        for mesh in ({"batch": 1, "model": 2}, {"batch": 2, "model": 2}, {"batch": 1, "model": 4}):
            (cut_plan, cut_output), (whole_plan, whole_output) = (_decisions(m, layout, mesh) for m in (small, large))
            assert {name: whole_plan[name] for name in cut_plan} == cut_plan, (layout, mesh)
            assert set(cut_plan.values()) == set(whole_plan.values()) and cut_output == whole_output, (layout, mesh)
    assert len(small.layers) < len(large.layers) / 3


def test_layers_are_chosen_by_type_not_by_name():
    model = user_models.renamed_convnet((16, 16, 3), 10)
    plan = make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    assert {p: s for p, s in plan.specs.items() if "model" in s} == {
        "alpha/kernel": ["-", "-", "-", "model"], "alpha/bias": ["model"],
        "delta/kernel": ["-", "-", "-", "model"], "delta/bias": ["model"],
        "iota/kernel": ["-", "model"], "iota/bias": ["model"],
        **{f"{bn}/{v}": ["model"] for bn in ("beta", "epsilon")
           for v in ("gamma", "beta", "moving_mean", "moving_variance")}}
    assert plan["eta"].impl == "SliceAvgPool2D"
    with pytest.raises(UsageError, match="--layout=fc_only splits Dense layers and .* has none"):
        make_plan(keras.Sequential([keras.Input((8, 8, 1)), L.Conv2D(4, 3), L.GlobalAveragePooling2D()]),
                  "fc_only", [], {"batch": 1, "model": 2})


def test_a_nested_model_is_placed_layer_by_layer():
    inner = keras.Sequential([keras.Input((8, 8, 4)), L.Conv2D(8, 3, padding="same", name="inner_conv"),
                              L.ReLU(name="inner_relu")], name="block")
    x = inputs = keras.Input((8, 8, 3), name="img")
    x = L.Conv2D(4, 3, padding="same", name="stem")(x)
    x = inner(x)
    x = L.GlobalAveragePooling2D(name="pool")(x)
    model = keras.Model(inputs, L.Dense(10, name="head")(x))
    plan = make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    assert [p.name for p in plan.layers] == ["img", "stem", "inner_conv", "inner_relu", "pool", "head"]
    assert plan["inner_conv"].node.inputs == ("stem",) and plan["pool"].node.inputs == ("inner_relu",)
    assert plan["inner_conv"].impl == "SplitConv2D" and plan["inner_conv"].collectives[0].op == "all_gather"


class Scale(keras.layers.Layer):
    """A user's layer with a weight, which the plan cannot know how to split."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale


def test_a_custom_layer_with_weights_on_split_activations_is_refused_by_name():
    x = inputs = keras.Input((8, 8, 3))
    x = L.Conv2D(8, 3, name="conv")(x)
    x = Scale(name="my_scale")(x)
    model = keras.Model(inputs, L.Dense(10, name="head")(L.Flatten()(x)))
    with pytest.raises(UsageError, match=r"^layer my_scale \(Scale\) receives activations split on 'model' and "
                                         r"has weights and no split-aware version: replicate"):
        make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    make_plan(model, "fc_only", [], {"batch": 1, "model": 2})   # replicated convolutions: fine


def test_a_weightless_layer_that_needs_whole_channels_gathers_first():
    x = inputs = keras.Input((8, 8, 3))
    x = L.Conv2D(8, 3, name="conv")(x)
    x = L.Reshape((36, 8), name="reshape")(x)
    model = keras.Model(inputs, L.Dense(10, name="head")(L.Flatten(name="flat")(x)))
    plan = make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    assert plan["reshape"].impl == "GatherReshape" and plan["reshape"].out_layout == WHOLE
    assert plan["reshape"].collectives[0].elems_per_example == 6 * 6 * 8


def test_a_users_layer_of_two_inputs_gathers_whichever_is_split(applications_idioms_plan):
    """InceptionResNetV2's CustomScaleLayer: before, the plan read the first input's layout
    only, ran the layer on a split second input as if whole, and gathered the list as one
    tensor. Now any split input makes it gather, and only the split inputs are counted."""
    plan = applications_idioms_plan
    for name, split_input in (("scale_whole_first", "residual"), ("scale_split_first", "mix")):
        placed = plan[name]
        assert placed.impl == "GatherScaledSum" and placed.out_layout == WHOLE and placed.gathers, name
        assert [plan[p].out_layout for p in placed.node.inputs].count(CHANNELS) == 1, name
        gathered = sum(c.elems_per_example for c in placed.collectives if c.op == "all_gather")
        assert gathered == plan[split_input].node.out_elems, name
        # it keeps its gathered (new, whole) input for the backward, not the whole one again
        assert saved_elems(plan)[name] == placed.node.out_elems + gathered, name
    # a whole operand added to a split one is sliced, and the merge knows which operand was whole
    assert plan["merge"].impl == "SplitAdd" and plan["merge"].in_layouts == (WHOLE, CHANNELS)


def test_layer_normalization_stays_on_split_channels_and_all_reduces_its_statistics():
    """ConvNeXt's LayerNormalization was refused on split channels ("has weights and no
    split-aware version"). It runs stock there: gamma and beta follow the channels, and its
    per-position mean and variance (and their gradients) are all-reduced over `model`."""
    plan = make_plan(user_models.layernorm_convnet((16, 16, 3), 10), "filter_split", [], {"batch": 1, "model": 2})
    norm = plan["norm"]
    assert norm.impl == "" and norm.in_layouts == (CHANNELS,) and norm.out_layout == CHANNELS
    assert plan.specs["norm/gamma"] == plan.specs["norm/beta"] == ["model"]
    assert [(c.op, c.phase, c.elems_per_example) for c in norm.collectives] == [
        ("all_reduce", "forward", 2 * 16 * 16), ("all_reduce", "backward", 2 * 16 * 16)]
    # its normalised input, split; not its output: conv2's backward reads the gathered copy
    assert saved_elems(plan)["norm"] == 16 * 16 * 8 // 2 and saved_elems(plan)["conv2"] == 16 * 16 * 8
    x = inputs = keras.Input((8, 8, 3))
    x = L.LayerNormalization(axis=(1, 2, 3), name="all_axes")(L.Conv2D(8, 3, name="conv")(x))
    model = keras.Model(inputs, L.Dense(10, name="head")(L.Flatten()(x)))
    with pytest.raises(UsageError, match=r"^layer all_axes \(LayerNormalization\) receives activations split on "
                                         r"'model' and normalises axis \[1, 2, 3\], not the split channels alone"):
        make_plan(model, "filter_split", [], {"batch": 1, "model": 2})


@pytest.fixture(scope="module")
def applications_idioms_plan():
    return make_plan(user_models.applications_idioms((16, 16, 3), 10), "filter_split", [], {"batch": 1, "model": 2})


def test_no_module_but_the_plan_walks_layers_to_place_them():
    """The converter, planner, reports and memory read the plan; none iterates model.layers."""
    walkers = []
    for folder in ("parallel", "planner", "profiling", "training"):
        for root, _, files in os.walk(os.path.join(REPO, "tf_multigpu", folder)):
            for name in files:
                path = os.path.join(root, name)
                if name.endswith(".py") and name != "placement.py":
                    if re.search(r"\b\w*(model|plain)\w*\.(layers|operations)\b", open(path).read()):
                        walkers.append(os.path.relpath(path, REPO))
    assert walkers == []


def test_both_parallelisms_declare_the_interface(devices):
    from tf_multigpu.parallel import Parallelism, make_parallelism
    for par in (make_parallelism("data", devices[:2], 8), make_parallelism("single", devices[:1], 8)):
        assert isinstance(par, Parallelism) and not par.spmd_lowered and par.mesh_shape["model"] == 1
    # (DTensor meshes are made by the tests marked `in_process_mesh`, in one process: conftest.py)


def test_layers_dtensor_refuses_run_their_twin_on_any_layout(mobilenet_v2):
    """DTensor has no layout propagation for AvgPoolGrad or the depthwise backprops on ANY
    layout: under fc_only (whole activations) MobileNetV2's depthwise convolutions still run
    SplitDepthwiseConv2D, with their kernels whole."""
    plan = make_plan(mobilenet_v2, "fc_only", [], {"batch": 2, "model": 2})
    depthwise = [p for p in plan.layers if p.node.cls is L.DepthwiseConv2D]
    assert {p.impl for p in depthwise} == {"SplitDepthwiseConv2D"}
    assert all(p.in_layouts == (WHOLE,) and not plan.split_on_model(p.node.weight("kernel")) for p in depthwise)


def test_bare_ops_between_layers_are_placed_and_refused_on_channels_split_unlike():
    """Keras ops written between layers (`x + 3.0` in MobileNetV3's hard-sigmoid, ConvNeXt's
    residual `inputs + x`) are graph nodes that are not layers: every plan used to fail on them
    with `KeyError: 'add'`, single-device training included. Elementwise ones run on channels
    split alike (each device its channels); others, or operands split unlike, are refused."""
    inputs = keras.Input((16, 16, 3))
    x = L.Conv2D(8, 3, name="c1")(inputs)
    x = keras.ops.relu(x + 3.0) * (1 / 6)   # a hard-sigmoid of bare ops
    x = keras.ops.clip(x * np.float32(1.5), 0.0, 6.0)   # a numpy scalar (np.float64 is a Python float)
    x = L.Conv2D(8, 3, name="c2")(x)
    model = keras.Model(inputs, L.Dense(10, name="logits")(L.GlobalAveragePooling2D()(x)), name="m")
    plan = make_plan(model, "", [], {"batch": 2, "model": 1})
    c2 = plan["c2"].node
    bare = [layer.node for layer in plan.layers if not issubclass(layer.node.cls, keras.layers.Layer)]
    assert len(bare) == 5 and c2.inputs == (bare[-1].name,) and bare[0].inputs == ("c1",)
    assert all(n.out_shape == (14, 14, 8) and not n.weights for n in bare)
    # each keeps what its gradient reads: nothing (+, * a scalar), its output (relu), or for
    # the clip its two masks and two maps of zeros, and its output, which c2's kernel reads
    assert [saved_elems(plan)[n.name] for n in bare] == [0, 14 * 14 * 8, 0, 0, 14 * 14 * 8 * 7 // 2]
    split = make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    assert all(split[n.name].out_layout == CHANNELS and not split[n.name].collectives for n in bare)
    assert split["c2"].in_layouts == (CHANNELS,) and split["c2"].gathers
    # fc_only splits the classifier only: the bare ops see whole activations and run as they are
    assert all(layer.impl == "" and layer.out_layout == WHOLE
               for layer in make_plan(model, "fc_only", [], {"batch": 1, "model": 2}).layers if layer.node in bare)
    refused = (r"^layer (add|reshape)(_\d+)? \((Add|Reshape)\) receives activations split on 'model' and is a bare op "
               r"between layers \(keras.ops\) other than an elementwise one on operands split alike")
    # a whole operand first and a split one second is refused
    inputs = keras.Input((16, 16, 8))
    x = inputs + L.Conv2D(8, 3, padding="same", name="c1")(inputs)
    residual = keras.Model(inputs, L.Dense(10, name="logits")(L.GlobalAveragePooling2D()(x)), name="r")
    with pytest.raises(UsageError, match=refused):
        make_plan(residual, "filter_split", [], {"batch": 1, "model": 2})
    # so is an op that mixes the channels
    x = keras.ops.reshape(L.Conv2D(8, 3, padding="same", name="c1")(inputs), (-1, 16, 32, 4))
    mixed = keras.Model(inputs, L.Dense(10, name="logits")(L.GlobalAveragePooling2D()(x)), name="mixed")
    with pytest.raises(UsageError, match=refused):
        make_plan(mixed, "filter_split", [], {"batch": 1, "model": 2})


def test_layer_scale_of_keras_applications_follows_the_channels(applications_idioms_plan):
    """ConvNeXt's LayerScale (`x * gamma`, a keras.applications layer) was refused on split
    channels ("has weights and no split-aware version"): its gamma is split with them."""
    plan = applications_idioms_plan
    assert plan["layer_scale"].impl == "" and plan["layer_scale"].out_layout == CHANNELS
    (gamma,) = plan["layer_scale"].node.weights
    assert plan.specs[gamma] == ["model"] and not plan["layer_scale"].collectives


def test_the_window_transient_is_counted_where_a_layer_runs_window_sum():
    """A 3x3 average pool on split channels runs as window_sum (the padded dy and one tap: 2
    input-sized tensors per device beside dy and dx); a tiling 2x2/2 one is a mean over a
    reshape and holds none."""
    model = keras.Sequential([keras.Input((16, 16, 3)), L.Conv2D(8, 3, name="conv"), L.AveragePooling2D(2, name="tile"),
                              L.AveragePooling2D(3, 1, padding="same", name="window"), L.GlobalAveragePooling2D(),
                              L.Dense(4, name="logits")])
    plan = make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
    assert plan["tile"].impl == plan["window"].impl == "SliceAvgPool2D"
    without = transient_elems(plan, plan["tile"])
    assert without == 14 * 14 * 8 // 2 + 7 * 7 * 8 // 2   # its input and output gradients
    assert transient_elems(plan, plan["window"]) == 7 * 7 * 8 // 2 * (1 + 1 + 2)
    # grouped: the einsums' group-major copies at stride 1 (9 input maps); a strided one's dx
    # runs stride phase by stride phase at the output's size (2)
    grouped = keras.Sequential([keras.Input((16, 16, 3)), L.Conv2D(8, 3, padding="same", name="conv"),
                                L.Conv2D(8, 3, padding="same", groups=2, name="g1"),
                                L.Conv2D(8, 3, strides=2, padding="same", groups=2, name="g2"),
                                L.GlobalAveragePooling2D(), L.Dense(4, name="logits")])
    plan = make_plan(grouped, "filter_split", [], {"batch": 1, "model": 2})
    maps = 16 * 16 * 8 // 2
    assert transient_elems(plan, plan["g1"]) == maps * (1 + 1 + 9)
    assert transient_elems(plan, plan["g2"]) == maps // 4 + maps * (1 + 2)
