"""`--strategy=model` and `--strategy=hybrid` on a DTensor mesh of ("batch", B) x ("model", M).

The model is the user's plain Keras model, cloned layer by layer as its placement plan
(placement.make_plan: the layout policy's (path regex -> spec) rules, checked against the
model's graph) says: its variables become DVariables with the plan's layouts, and the layers
whose inputs or kernels are split on `model` are swapped for the equivalents in `split_layers`
(same weights, same names; `_converter` sets their mesh). The step is the single-replica
step of every strategy, run once on the global batch: DTensor computes it SPMD on every
device, batch-sharded on `batch` (the data-parallel groups) and split on `model` inside each
group. With `batch_on_model` (the
conv_data_fc_model layout, mesh 1 x N) the input batch is sharded on `model` instead: layers
with replicated kernels run data parallel over all N devices (DTensor sums their weight
gradients over `model` by itself) until the first layer that gathers its input, which
all-gathers the batch.

Three DTensor/Keras facts shape this file (see BUILD_NOTES.md):
- Keras' `keras.distribution` is a no-op on the TensorFlow backend, so variables get their
  layouts from a `tf.variable_creator_scope` that returns DVariables (optimizer slots too).
- A variable creator is not told the variable's Keras path; Keras' name-scope stack plus the
  variable's name gives it, and a slot's name starts with its variable's path ('/' -> '_').
- `dtensor.unpack` only works eagerly, so results leave the mesh outside the tf.function.

Across workers (`parallel/cluster.py`) the mesh is DTensor's multi-client mesh over every
client's devices, client c holding global device ids [c*L, (c+1)*L). The code is the same:
`dtensor.pack` takes, and `dtensor.unpack` returns, only this client's devices' components,
so each client reads only the rows of the batch groups its devices are in.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tf_multigpu.compat import all_layers, keras_name_scope_path
from tf_multigpu.errors import UsageError, error_reason
from tf_multigpu.parallel import split_layers
from tf_multigpu.parallel.layouts import UNSPLIT
from tf_multigpu.parallel.lean_batchnorm import lean_batch_norm
from tf_multigpu.parallel.placement import CHANNELS, PlacementPlan, make_plan
from tf_multigpu.parallel.stateless_dropout import replaced as dropout_replaced
from tf_multigpu.parallel.stateless_dropout import stateless_dropout

U = dtensor.UNSHARDED

GATHER_LOWERING = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
# Marks the variable as set by us, so a command started from this process does not take our
# choice for its mesh as the user's for its own.
_OURS = "TF_MULTIGPU_CHOSE_GATHER_LOWERING"
_USER_GATHER_LOWERING = None if os.environ.get(_OURS) else os.environ.get(GATHER_LOWERING)   # the user's wins


def _choose_gather_lowering(mesh_shape: dict) -> None:
    """Lowers DTensor's all-gathers to CollectiveGatherV2 on a mesh whose only real axis is
    `model`, unless the user's environment chose.

    DTensor's default all-gather is a zero-filled tensor of the gathered size, the local part
    copied in, and an all-reduce into a third tensor: three gathered-size buffers and twice a
    gather's bytes. LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2 (read when a step is lowered;
    DTensor's own lowering tests use it) runs one CollectiveGatherV2 between two transposes
    instead: AlexNet 224, batch 64, model 1x4 peak RSS 3.15 -> 2.95 GiB (BUILD_NOTES, "DTensor's
    all-gather"). TF 2.21's version is wrong for a gather over both axes of a 2-D mesh (a
    relayout of [batch, ..., model] to replicated: "'tf.Reshape' op requires 'output' number
    of elements to match", or silently misordered values), so a mesh with a batch axis keeps
    the default lowering. The variable is process-wide: the last mesh made decides.
    """
    if _USER_GATHER_LOWERING is not None:
        return
    os.environ[_OURS] = "1"
    if mesh_shape["batch"] == 1:
        os.environ[GATHER_LOWERING] = "1"
    else:
        os.environ.pop(GATHER_LOWERING, None)


def restore_gather_lowering() -> None:
    """Puts the user's value (or its absence) back: what steps lowered from now on use."""
    os.environ.pop(_OURS, None)
    if _USER_GATHER_LOWERING is None:
        os.environ.pop(GATHER_LOWERING, None)
    else:
        os.environ[GATHER_LOWERING] = _USER_GATHER_LOWERING


class DTensorParallelism:
    """Runs the single-replica step on the global batch over a batch x model DTensor mesh.

    The mesh shape, the layout and the global batch are checked before (config/plan_checks.py)."""

    def __init__(self, name: str, devices, mesh_shape: dict, layout: str, user_rules, global_batch: int,
                 local_devices=None, batch_on_model: bool = False, shard_slots: bool = False, overrides=()):
        # DTensor merges a step's independent all-reduces into one flat buffer (its
        # AllReduceCombineOptimization, read from the environment when a step is lowered). On a
        # mesh with a `batch` axis that is every gradient at once, assembled in a zero-filled
        # constant the size of all of them (constant-folded: held for the whole run) and copied
        # into a second buffer: 2 x the gradients more memory (AlexNet hybrid 2x2, batch 64:
        # 0.9 GiB of a 4.4 GiB allocator peak), and no gradient's all-reduce starts before the
        # last gradient exists. Off, unless the user's environment sets it.
        os.environ.setdefault("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", "0")
        _choose_gather_lowering(mesh_shape)
        self.name = name
        self.devices = list(devices)
        self.mesh_shape = mesh_shape
        self.layout_name, self.user_rules, self.overrides = layout, list(user_rules), list(overrides)
        self.global_batch = global_batch
        self.num_replicas = mesh_shape["batch"]
        dims = [("batch", mesh_shape["batch"]), ("model", mesh_shape["model"])]
        if local_devices is None:
            self.mesh = dtensor.create_mesh(dims, devices=[d.split("device:")[-1] for d in self.devices])
        else:   # a multi-client mesh: every client names its own devices
            self.mesh = dtensor.create_distributed_mesh(
                dims, local_devices=[d.split("device:")[-1] for d in local_devices])
        self.spans_workers = local_devices is not None
        self.spmd_lowered = True   # collectives exist only after DTensor's SPMD expansion
        # The batch groups this client's devices are in, and so the rows of each global batch
        # it reads: the i-th of n equal slices (all of them in one process).
        self.local_ids = list(self.mesh.local_device_ids())
        self.local_groups = sorted({d // mesh_shape["model"] for d in self.local_ids})
        per_client = len(self.local_groups)
        self.input_shard = (self.local_groups[0] // per_client, mesh_shape["batch"] // per_client)
        self.batch_on_model = batch_on_model   # the input's batch sharded on `model` (mesh 1 x N)
        self.shard_slots = shard_slots         # asked for; the plan says where it applies (B > 1)
        self.plan: PlacementPlan | None = None   # set by build_model
        self._by_path = {}       # variable path -> layout (slots look theirs up here)
        self._layouts = {}       # id(DVariable) -> its layout (relayout_like)
        self._planned = {}       # a clone's variable path -> the plan's path of that variable
        self._unnamed_seen = {}  # (layer path, unnumbered name) -> unnamed weights created so far

    @property
    def replica_batch(self) -> int:
        return self.global_batch // self.num_replicas

    # -- variables -------------------------------------------------------------------------
    def layout(self, spec) -> dtensor.Layout:
        return dtensor.Layout([U if axis == UNSPLIT else axis for axis in spec], self.mesh)

    def _layout_for(self, path: str, name: str, shape) -> dtensor.Layout:
        if path in self._by_path:
            return self._by_path[path]
        for var_path, layout in self._by_path.items():   # an optimizer slot: its variable's path
            if name.startswith(var_path.replace("/", "_") + "_") and layout.rank == len(shape):
                return self.layout(self.plan.slot_spec(var_path, shape))
        spec = self.plan.specs.get(path) if self.plan else None
        return self.layout(spec) if spec else dtensor.Layout.replicated(self.mesh, len(shape))

    def _plan_path(self, path: str) -> str:
        """The plan's path of the variable a clone creates at `path`. They differ where the
        user built the layer under `keras.name_scope` (NASNet: `block/conv1/kernel` in the
        model, `conv1/kernel` in its clone, which does not repeat the scope); layer names are
        unique in a model, so the one plan path ending in the clone's is the variable."""
        if not self.plan or path in self.plan.specs:
            return path
        scoped = [p for p in self.plan.specs if p.endswith("/" + path)]
        if len(scoped) == 1:
            return scoped[0]
        # A weight made without a name (`add_weight(shape)`: ConvNeXt's LayerScale) is numbered
        # by Keras process-wide, in creation order: `layer_scale/variable_18` in the model is
        # `layer_scale/variable_36` in its clone. The clone creates a layer's weights in the
        # model's order, so its k-th such weight is the plan's k-th (the creator asks once per
        # variable: this counts).
        layer, _, name = path.rpartition("/")
        unnumbered = [p for p in self.plan.specs if _unnumbered(p.rpartition("/")[2]) == _unnumbered(name)
                      and (p.rpartition("/")[0] == layer or p.rpartition("/")[0].endswith("/" + layer))]
        k = self._unnamed_seen.get((layer, _unnumbered(name)), 0)
        if k < len(unnumbered):
            self._unnamed_seen[(layer, _unnumbered(name))] = k + 1
            return unnumbered[k]
        return path

    def _creator(self, next_creator, **kwargs):
        name = kwargs.get("name") or "variable"
        scope = keras_name_scope_path()
        path = f"{scope}/{name}" if scope else name
        planned = self._planned[path] = self._plan_path(path)
        initial = kwargs["initial_value"]
        # Keras makes an optimizer slot's initial value under colocate_with(its variable), i.e.
        # on the DTensor device, where an op with no DTensor input runs on the device's default
        # mesh: the FIRST mesh the process used (DTensorDevice::AddMesh), not this one. Copying
        # it from an earlier, smaller mesh to this one never finished (a 1x2 mesh's test before
        # a 1x4 build hung in assign_variable_op): make it on this mesh.
        with dtensor.default_mesh(self.mesh):
            initial = tf.convert_to_tensor(initial() if callable(initial) else initial, dtype=kwargs.get("dtype"))
        layout = self._layout_for(planned, name, initial.shape.as_list())
        if self.plan and planned in self.plan.specs:
            self._by_path[path] = layout
        variable = dtensor.DVariable(self.put(initial, layout), trainable=kwargs.get("trainable", True), name=name)
        self._layouts[id(variable)] = layout
        return variable

    def relayout_like(self, value, variable):
        """`value` in the layout of (Keras or DTensor) `variable`: the optimizer's hook for slots
        sharded more finely than their variables (placement.slot_spec). Sharding a value that
        is replicated on `batch` is local slicing; the way back is an all-gather over `batch`."""
        if not self.plan.shard_slots:   # every slot has its variable's layout: nothing to move
            return value
        return dtensor.relayout(value, self._layout_of(variable))

    def split_dims(self, variable) -> tuple:
        """The dimensions of (Keras or DTensor) `variable` that its layout splits over a mesh axis:
        the optimizer slices a tensor of that layout only along the others (no collective)."""
        return tuple(d for d, axis in enumerate(self._layout_of(variable).sharding_specs) if axis != U)

    def _layout_of(self, variable):
        """The layout this parallelism gave (Keras or DTensor) `variable` when it was created."""
        return self._layouts[id(variable if isinstance(variable, tf.Variable) else variable.value)]

    def scope(self) -> contextlib.AbstractContextManager:
        """Variables created here (model, optimizer) are DVariables with the policy's layouts."""
        return tf.variable_creator_scope(self._creator)

    def put(self, value, layout: dtensor.Layout):
        """A host value as a DTensor with `layout`."""
        value = tf.convert_to_tensor(value)
        return dtensor.relayout(dtensor.copy_to_mesh(value, dtensor.Layout.replicated(self.mesh, value.shape.rank)),
                                layout)

    def to_numpy(self, variable) -> np.ndarray:
        """The global value of a (sharded) variable, gathered to the host."""
        value = _read(variable)
        full = dtensor.relayout(value, dtensor.Layout.replicated(self.mesh, value.shape.rank))
        return dtensor.unpack(full)[0].numpy()

    def any_worker(self, flag: bool) -> bool:
        """True on every client if `flag` is true on any (one max-reduce over the mesh)."""
        if not self.spans_workers:
            return flag
        layout = dtensor.Layout(["batch", "model"], self.mesh)
        flags = dtensor.pack([tf.constant([[1.0 if flag else 0.0]])] * len(self.local_ids), layout)
        return bool(dtensor.unpack(_mesh_max(flags))[0].numpy() > 0)

    def local_shape(self, variable) -> list:
        """The shape of one device's shard of a variable."""
        return dtensor.unpack(_read(variable))[0].shape.as_list()

    # -- the model ---------------------------------------------------------------------------
    def build_model(self, build: Callable[[], keras.Model]) -> keras.Model:
        """Builds the plain model, plans its placement, then builds its model-parallel twin
        with the same initial values."""
        plain = build()
        self.plan = make_plan(plain, self.layout_name, self.user_rules, self.mesh_shape, self.batch_on_model,
                              shard_slots=self.shard_slots, overrides=self.overrides)
        try:
            with self.scope():
                model = keras.models.clone_model(plain, clone_function=self._converter(), recursive=True)
        except UsageError:
            raise
        except ValueError as e:
            raise UsageError(f"model parallelism needs a Sequential or functional Keras model ({e})") from None
        # Same initial values as the plain model (hence as every other strategy). The weights
        # pair up by path; other RNG states (no stable path: clones renumber them) by order. The
        # stock Dropout's seed state has no counterpart in the clone (StatelessDropout has none).
        pairs = list(zip(model.weights, plain.weights)) + list(zip(_rng_states(model), _rng_states(plain)))
        for var, value in pairs:
            if value.path in self.plan.specs and self._planned.get(var.path, var.path) != value.path:
                raise AssertionError(f"cloned model's variables are out of order: {var.path} vs {value.path}")
            var.assign(self.put(value, self._layout_for(var.path, var.name, list(var.shape))))
        self._state_on_mesh(model)
        return model

    def _state_on_mesh(self, model: keras.Model):
        """The state layers keep beside their variables, made right on the mesh once the
        variables hold the model's values:
        - state derived from weights (an adapted Normalization's mean) is derived again: the
          clone's build derived it from its initial values (`finalize_state`);
        - plain tensors kept as attributes (a Normalization built with a given mean and
          variance: EfficientNetV2's and ConvNeXt's preprocessing) become replicated copies on
          the mesh: a DTensor step refuses a plain tensor it captures ("got a regular tensor for
          input 2 (shape [1,1,1,3]) but was expecting a DTensor")."""
        for layer in all_layers(model):
            if hasattr(layer, "finalize_state"):
                layer.finalize_state()
            for name, value in list(vars(layer).items()):
                if isinstance(value, tf.Tensor) and not dtensor.is_dtensor(value):
                    setattr(layer, name, self.put(value, dtensor.Layout.replicated(self.mesh, value.shape.rank)))

    def _converter(self):
        """clone_function: each layer as the plan says, its stock class or a split-aware twin."""
        plan = self.plan

        def convert(layer):
            if isinstance(layer, keras.Model):   # nested models are cloned layer by layer (recursive)
                return layer
            try:
                return convert_layer(layer)
            except (TypeError, ValueError, NotImplementedError) as e:   # a user's layer without a usable config
                ours = _usage_error_within(e)
                if ours:   # ours, with its own fix (a split layer's geometry, wrapped by Keras' from_config in a
                    raise ours from None   # TypeError; the plan's class; a bare op on float64 logits)
                raise UsageError(f"layer {layer.name} ({type(layer).__name__}) cannot be made again from its "
                                 f"get_config() ({error_reason(e)}), which model parallelism does to place it: "
                                 "pass its __init__'s **kwargs on to super().__init__ and give it a get_config() "
                                 "that returns its own arguments, or use --strategy=data") from None

        def convert_layer(layer):
            placed = plan[layer.name]
            gathers_logits = (placed is plan.layers[-1] and plan.output_layout == CHANNELS
                              and keras.config.floatx() == "float64")
            if gathers_logits and not isinstance(layer, keras.layers.Layer):
                raise UsageError(f"the model's output comes from a bare op ({layer.name}) on logits split over "
                                 "'model', which float64 cannot gather: end the model with a layer")
            impl = placed.impl
            if impl.endswith("WholeGroupedConv2D") and self.mesh.device_type() != "CPU":
                # A whole grouped convolution runs as window_sum only where TensorFlow's kernels
                # have no gradient for it, on CPUs (split_layers.WholeGroupedConv2D).
                impl = f"Gather{type(layer).__name__}" if impl.startswith("Gather") else ""
            if impl:
                new = _implementation(impl, type(layer)).from_config(layer.get_config())
            else:
                # Dropout -> StatelessDropout, BatchNormalization -> LeanBatchNormalization, else a fresh copy
                new = lean_batch_norm(stateless_dropout(layer))
                if not gathers_logits:
                    return new
            if gathers_logits:
                # DTensor's softmax cross-entropy over float64 logits split on classes is wrong
                # (TF 2.21: the loss off by 7.3 and its gradient by 1.0 on 4 x 6 logits, where
                # float32's is right): float64 logits (the parity checks' exact mode) reach the
                # loss whole. The argmax of the accuracy gathers them anyway: no extra traffic.
                new = type(type(new).__name__, (split_layers.GatherOutput, type(new)), {}).from_config(new.get_config())
            new.mesh = self.mesh
            if placed.kernel_split:
                new.need_input_grad = placed.needs_input_grad   # nothing upstream to send a gradient to
            if placed.merge_layout:
                new.split_output = placed.out_layout != "whole"
                new.split_inputs = tuple(layout == CHANNELS for layout in placed.in_layouts)
            return new

        return convert

    # -- data and steps ----------------------------------------------------------------------
    def distribute(self, make_dataset: Callable[[int], tf.data.Dataset]):
        """Batches sharded on `batch`: data-parallel group i gets the i-th of B consecutive
        per-replica batches, i.e. rows [i*G/B, (i+1)*G/B) of the global batch, as
        MirroredStrategy gives replica i.

        We pack the batches ourselves: `dtensor.DTensorDataset` (TF 2.21) feeds every group
        the SAME rows when the mesh uses fewer devices than exist (it counts all devices of
        the type, not the mesh's), which silently trains on a fraction of the data.
        """
        if self.batch_on_model:   # device d of the 1 x N mesh gets rows [d*G/N, (d+1)*G/N) of the images
            return _MeshBatches(make_dataset(self.global_batch // self.mesh_shape["model"]), self.mesh, 1,
                                self.local_ids, axis="model", whole_labels=True)
        return _MeshBatches(make_dataset(self.replica_batch), self.mesh, self.mesh_shape["model"], self.local_ids)

    def compile(self, step_fn: Callable[..., dict]) -> Callable:
        """`run(iterator, num_steps)`: `num_steps` steps on the mesh; returns summed scalars.

        One tf.function call per step: the input is packed onto the mesh on the host, between
        calls (DTensor iterators cannot be fed from our own packing inside a function).
        """
        step = tf.function(step_fn)

        def run(iterator, num_steps):
            totals = None
            for _ in range(int(num_steps)):
                out = step(*next(iterator))
                totals = out if totals is None else {k: totals[k] + out[k] for k in totals}
            # The scalars are replicated on the mesh: any device's copy is the value.
            return {k: dtensor.unpack(v)[0] for k, v in totals.items()}

        return run


def _usage_error_within(e: BaseException) -> UsageError | None:
    """The UsageError an exception was raised while handling, if any: Keras' `from_config`
    re-raises whatever a layer's constructor raised as "TypeError: Error when deserializing
    class ..." (keras/src/ops/operation.py), with the original as its context only."""
    while e is not None:
        if isinstance(e, UsageError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _unnumbered(name: str) -> str:
    """A variable name without the `_N` Keras appends to make it unique (`variable_18`)."""
    return re.sub(r"_\d+$", "", name)


def _implementation(name: str, stock: type) -> type:
    """The split-aware class the plan names: one of `split_layers`', or, for a layer that needs
    its whole input ("Gather<Class>": Conv2D, Dense, Flatten...), the stock class after a named
    gather."""
    cls = getattr(split_layers, name, None)
    if cls is not None:
        return cls
    if name == f"Gather{stock.__name__}" and issubclass(stock, keras.layers.Layer):
        return type(name, (split_layers.GatherFirst, stock), {})
    if name.startswith("Gather") and hasattr(split_layers, name[len("Gather"):]):   # e.g. a whole grouped conv
        return type(name, (split_layers.GatherFirst, getattr(split_layers, name[len("Gather"):])), {})
    raise UsageError(f"the placement plan asks for {name}, which this version does not have: "
                     "replicate the layer before it (--layout=fc_only or a --layout_rules rule)")


@tf.function
def _mesh_max(values):
    return tf.reduce_max(values)


def _rng_states(model) -> list:
    """The model's variables that are not weights (RNG states), except stock Dropouts' (the
    clone's StatelessDropouts replace those and hold none)."""
    weights = {id(w) for w in model.weights}
    dropout_states = {id(layer.seed_generator.state) for layer in all_layers(model)
                      if dropout_replaced(layer) and hasattr(layer, "seed_generator")}
    return [v for v in model.variables if id(v) not in weights and id(v) not in dropout_states]


def _read(variable):
    """The DTensor value of a Keras variable (or of a DVariable)."""
    return variable.value.read_value() if hasattr(variable, "value") else variable.read_value()


class _MeshBatches:
    """Iterable of global batches as DTensors sharded on mesh axis `axis`, from per-replica
    batches: each batch goes to `per_group` consecutive devices of the (row-major) mesh.

    The dataset holds, for each step, the per-replica batches of this client's groups in order
    (all groups in one process); each local device gets its group's batch.

    With `whole_labels`, the elements after the images (labels; eval weights) are the whole
    batch's on every device instead: conv_data_fc_model splits the classifier's logits on
    classes over `model`, and DTensor cannot take a loss of logits split on classes with
    labels split on rows over the same axis ("Non-contracting dimension for left argument of
    matmul has sharding dimension model ... not supported", in the backward). Labels are G
    integers: copying them costs nothing, and DTensor slices them where the logits are rows.
    """

    def __init__(self, dataset: tf.data.Dataset, mesh, per_group: int, local_ids, axis: str = "batch",
                 whole_labels: bool = False):
        self.dataset, self.mesh, self.axis = dataset, mesh, axis
        self.per_group, self.whole_labels = per_group, whole_labels
        self.local_ids = list(local_ids)
        self.groups = sorted({d // self.per_group for d in self.local_ids})

    def __iter__(self):
        ranks = [spec.shape.rank for spec in self.dataset.element_spec]
        batches = iter(self.dataset)
        while True:
            try:
                parts = dict(zip(self.groups, [next(batches) for _ in self.groups]))
            except StopIteration:
                return
            out = []
            for k, rank in enumerate(ranks):
                if k and self.whole_labels:   # one process: every group's rows are here
                    whole = tf.concat([parts[g][k] for g in self.groups], axis=0)
                    out.append(dtensor.pack([whole] * len(self.local_ids), dtensor.Layout.replicated(self.mesh, rank)))
                else:   # mesh devices are numbered row-major: device d is in group d // per_group
                    out.append(dtensor.pack([parts[d // self.per_group][k] for d in self.local_ids],
                                            dtensor.Layout.batch_sharded(self.mesh, self.axis, rank)))
            yield tuple(out)

