"""Dropout whose masks are the same under every strategy, mesh and device count.

Keras' Dropout draws its mask from a per-layer SeedGenerator, so N replicas draw N masks that
are not one device's mask over the global batch, and a run's training depends on the number
of devices. `StatelessDropout` (a drop-in `keras.layers.Dropout`: same config, same name, no
weights) instead draws each element's keep/drop bit as a pure function of

    (the layer's seed, its position among the model's dropouts, the training step, the
     element's GLOBAL coordinates)

so the same seed trains the same network whatever the strategy. The position, not the name:
Keras numbers unnamed layers per process (dropout, dropout_1, ...), so the same model built a
second time in one process (--strategy=auto's planner builds it first; a parity check builds
one device's model and the split one) drew other masks under a name-keyed hash (measured: a
model 1x2 step 0.96 apart from one device's, and `--strategy=auto` choosing single trained
another network than `--strategy=single`). Every parallelism swaps it in
for `keras.layers.Dropout` at build time with `stateless_dropout(layer)` (the models stay
plain Keras), and the loop binds the step counter with `use_step(model, optimizer.iterations)`.

Why a counter-based hash and not `tf.random.stateless_uniform`: the mask of one replica's rows
must equal the same rows of the global batch's mask. A stateless draw of one replica's share
is not a slice of the draw of the whole batch, and under DTensor a stateless draw with a sharded
output folds the device id into the seed (measured: a batch- or model-sharded
`stateless_uniform` differs from the one-device draw; BUILD_NOTES.md). Hashing each element's
global index is elementwise, so the bits cannot depend on layout, sharding or device count,
and under tf.distribute each replica computes only its own rows.

The global row index: under tf.distribute replica i holds rows [i*b, (i+1)*b) of the global
batch (also across workers: `replica_id_in_sync_group` counts every worker's replicas), so its
rows start at i*b; under DTensor the layer sees the global batch (replica 0 of the default
context), so they start at 0. The step is the optimizer's iteration count, which the
checkpoint restores, so a resumed run draws the masks of an uninterrupted one.
"""

from __future__ import annotations

import zlib

import keras
import tensorflow as tf

from tf_multigpu.compat import all_layers

_U32 = tf.uint32


def _mix(h):
    """A 32-bit finalising hash (Wellons' lowbias32: full avalanche, a bijection on uint32)."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, _U32)))
    h = h * tf.constant(0x7FEB352D, _U32)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(15, _U32)))
    h = h * tf.constant(0x846CA68B, _U32)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, _U32)))


def keep_mask(shape, rate: float, key, row_offset):
    """Boolean mask of `shape` (rows first): element (r, f) is kept with probability 1 - rate,
    decided by hash(key, row_offset + r, f) alone (f: the element's flat index in its row)."""
    rows = tf.cast(tf.range(shape[0]), _U32) + tf.cast(row_offset, _U32)
    per_row = tf.reduce_prod(shape[1:])
    features = tf.cast(tf.range(per_row), _U32)
    bits = _mix(tf.bitwise.bitwise_xor(_mix(tf.bitwise.bitwise_xor(rows, key))[:, None], features[None, :]))
    # The top 24 bits as a float in [0, 1): exact in float32, like Keras' uniform draw.
    uniform = tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, _U32)), tf.float32) * (2.0 ** -24)
    return tf.reshape(uniform >= rate, shape)


class StatelessDropout(keras.layers.Dropout):
    """keras.layers.Dropout with masks drawn from (seed, position, step, global row, feature).

    `seed` is required (`stateless_dropout` takes it from the layer it replaces); the step
    counter and the layer's position among the model's dropouts are bound after the optimizer
    exists (`use_step`). Without a counter, training=True is
    refused rather than silently reusing one mask every step.
    """

    def __init__(self, rate, noise_shape=None, seed=0, **kwargs):
        # keras.layers.Layer, not Dropout.__init__: that creates a SeedGenerator variable this
        # layer never uses, which would leave the layer with state the stock one has not.
        keras.layers.Layer.__init__(self, **kwargs)
        if not 0 <= rate <= 1:
            raise ValueError(f"Invalid value received for argument `rate`: {rate} (a float in [0, 1])")
        self.rate = rate
        self.seed = int(seed)
        self.noise_shape = None if noise_shape is None else tuple(noise_shape)
        self.supports_masking = True
        self._position = 0   # use_step sets it
        self.built = True   # no weights: nothing to build

    def use_step(self, step, position: int = 0) -> None:
        """Binds the training-step counter (a variable) and the layer's position among its
        model's dropouts (module docstring); object.__setattr__ keeps Keras from tracking the
        counter as this layer's own variable (it belongs to the optimizer)."""
        object.__setattr__(self, "_step", step)
        self._position = int(position)

    def _key(self):
        step = getattr(self, "_step", None)
        if step is None:
            raise RuntimeError(f"{self.name} (StatelessDropout) has no step counter: call "
                               "tf_multigpu.parallel.stateless_dropout.use_step(model, optimizer.iterations)")
        position_hash = zlib.crc32(f"dropout {self._position}".encode()) & 0xFFFFFFFF
        seed = tf.constant(self.seed & 0xFFFFFFFF, _U32)
        step = tf.cast(tf.cast(tf.convert_to_tensor(step), tf.int64) & 0xFFFFFFFF, _U32)
        return _mix(tf.bitwise.bitwise_xor(seed, _mix(tf.bitwise.bitwise_xor(tf.constant(position_hash, _U32),
                                                                          _mix(step)))))

    def call(self, inputs, training=False):
        if not (training and self.rate > 0):
            return inputs
        if self.rate >= 1:
            return tf.zeros_like(inputs)
        shape = tf.shape(inputs)
        if self.noise_shape is not None:
            shape = tf.stack([shape[i] if d is None else d for i, d in enumerate(self.noise_shape)])
        # Only a mask with a row per example is offset to this replica's global rows; a
        # noise_shape of 1 on the batch shares one row of mask among all examples.
        per_example = self.noise_shape is None or self.noise_shape[0] is None
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group if (context and per_example) else 0
        keep = keep_mask(shape, self.rate, self._key(), tf.cast(replica, tf.int32) * shape[0])
        scaled = inputs / tf.cast(1.0 - self.rate, inputs.dtype)
        return tf.where(keep, scaled, tf.zeros_like(inputs))


def stateless_dropout(layer):
    """clone_function for keras.models.clone_model: a stock Dropout becomes a StatelessDropout
    with the same config, its seed taken from the stock layer's seed generator (so it follows
    keras.utils.set_random_seed as the stock layer did); any other layer is a fresh copy.

    keras.layers.Dropout and SpatialDropout1D/2D/3D are replaced (a spatial dropout is a
    dropout whose mask has one value per example and channel: `noise_shape` 1 on the spatial
    axes). Other layers that draw random numbers (GaussianNoise, GaussianDropout, AlphaDropout,
    a user's own Dropout subclass) are copied as they are: they draw per device, a valid
    noise but not one device's (`random_layers` names them for a note).
    """
    if not replaced(layer):
        return layer.__class__.from_config(layer.get_config())
    spatial = _SPATIAL.get(type(layer))
    config = layer.get_config()
    if spatial is not None:
        first = config.pop("data_format", "channels_last") == "channels_first"
        config["noise_shape"] = (None, None, *[1] * spatial) if first else (None, *[1] * spatial, None)
    if config["seed"] is None:
        generator = getattr(layer, "seed_generator", None)   # absent when rate == 0
        config["seed"] = int(generator.state.numpy()[0]) if generator is not None else 0
    return StatelessDropout.from_config(config)


def replaced(layer) -> bool:
    """Whether stateless_dropout replaces `layer` by a StatelessDropout."""
    return type(layer) is keras.layers.Dropout or type(layer) in _SPATIAL


# Spatial dropouts, by their number of spatial axes.
_SPATIAL = {keras.layers.SpatialDropout1D: 1, keras.layers.SpatialDropout2D: 2, keras.layers.SpatialDropout3D: 3}


def random_layers(model) -> list:
    """The names of `model`'s layers that draw their own random numbers in training and are
    not made stateless: per device, their noise differs from one device's."""
    # Keras' random layers keep a SeedGenerator (GaussianNoise, GaussianDropout, AlphaDropout,
    # Dropout and its subclasses); a StatelessDropout has none.
    return [layer.name for layer in all_layers(model) if hasattr(layer, "seed_generator") and not replaced(layer)]


def use_step(model, step) -> None:
    """Gives every StatelessDropout of `model` (nested models included) its step counter and
    its position among them, in the order of the model's layers (which clone_model, and so
    every parallelism's conversion, keeps)."""
    dropouts = [layer for layer in all_layers(model) if isinstance(layer, StatelessDropout)]
    for position, layer in enumerate(dropouts):
        layer.use_step(step, position)
