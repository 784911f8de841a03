"""Dropout and BatchNorm train the same network under every strategy as on one device.

Dropout masks are drawn from (seed, layer, step, global row) (parallel/stateless_dropout.py);
BatchNorm statistics are all-reduced over the replicas (--batchnorm=sync). The model- and
hybrid-parallel steps with dropout are checked by tests/test_parity.py, whose one_step now
keeps the model's real dropout.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import checkpoint_values, max_update_difference, one_step
from tests.user_models import small_resnet_bn, spatial_dropout_convnet
from tf_multigpu.compat import new_mirrored_collective_keys
from tf_multigpu.config import Config
from tf_multigpu.data import load_source
from tf_multigpu.parallel import make_parallelism
from tf_multigpu.parallel.stateless_dropout import StatelessDropout, random_layers, stateless_dropout
from tf_multigpu.training.loop import train
from tf_multigpu.training.run import build_model_and_optimizer

BN_MODEL = "tests.user_models:small_resnet_bn"


def _dropout(rate=0.25, name="drop", step=0, position=0, **kwargs):
    layer = StatelessDropout(rate, seed=7, name=name, **kwargs)
    layer.use_step(tf.Variable(step, dtype=tf.int64), position)
    return layer


def test_masks_of_two_replicas_are_one_devices_mask(devices):
    """Each replica drops exactly the elements one device drops in its rows of the batch."""
    x = tf.reshape(tf.range(1, 8 * 6 * 5 + 1, dtype=tf.float32), [8, 6, 5])
    whole = _dropout()(x, training=True).numpy()
    new_mirrored_collective_keys()
    strategy = tf.distribute.MirroredStrategy(devices[:2])
    layer = _dropout()
    shares = strategy.experimental_distribute_values_from_function(lambda ctx: x[4 * ctx.replica_id_in_sync_group:][:4])
    per_replica = strategy.run(tf.function(lambda xs: layer(xs, training=True)), args=(shares,))
    replicas = np.concatenate([v.numpy() for v in per_replica.values])
    kept = whole != 0
    np.testing.assert_array_equal(replicas != 0, kept)   # the same elements dropped
    np.testing.assert_allclose(replicas, whole, rtol=1e-6)   # (a tf.function may multiply by 1/0.75)
    np.testing.assert_allclose(whole[kept], x.numpy()[kept] / 0.75, rtol=1e-6)


def test_masks_change_with_step_and_layer_and_drop_at_the_rate():
    x = tf.ones([64, 256])
    mask = _dropout()(x, training=True).numpy() != 0
    assert abs(1 - mask.mean() - 0.25) < 0.02
    assert (mask != (_dropout(step=1)(x, training=True).numpy() != 0)).mean() > 0.2
    assert (mask != (_dropout(position=1)(x, training=True).numpy() != 0)).mean() > 0.2
    # Not the name: Keras numbers unnamed layers per process, so a model built twice would differ.
    np.testing.assert_array_equal(mask, _dropout(name="dropout_7")(x, training=True).numpy() != 0)
    np.testing.assert_array_equal(_dropout()(x, training=False), x)   # inference: identity


def test_noise_shape_shares_the_mask_along_its_unit_dimensions():
    out = _dropout(0.5, noise_shape=(None, 1, 8))(tf.ones([4, 3, 8]), training=True).numpy()
    np.testing.assert_array_equal(out, np.broadcast_to(out[:, :1], out.shape))
    assert 0 < (out == 0).mean() < 1


def test_a_dropout_without_its_step_counter_refuses_to_train():
    with pytest.raises(RuntimeError, match="use_step"):
        StatelessDropout(0.5, seed=1, name="lonely")(tf.ones([2, 2]), training=True)


def test_swap_keeps_the_config_and_the_seed_of_the_stock_layer():
    keras.utils.set_random_seed(3)
    stock = keras.layers.Dropout(0.3, name="drop1")
    swapped = stateless_dropout(stock)
    assert type(swapped) is StatelessDropout and swapped.name == "drop1" and swapped.rate == 0.3
    assert swapped.seed == int(stock.seed_generator.state.numpy()[0])
    assert not swapped.variables   # no RNG state: the mask is a function of the step
    spatial = stateless_dropout(keras.layers.SpatialDropout2D(0.3, seed=4))   # one mask value per channel
    assert type(spatial) is StatelessDropout and spatial.noise_shape == (None, 1, 1, None) and spatial.seed == 4
    first = stateless_dropout(keras.layers.SpatialDropout2D(0.3, data_format="channels_first"))
    assert first.noise_shape == (None, None, 1, 1)
    assert type(stateless_dropout(keras.layers.GaussianNoise(0.1))) is keras.layers.GaussianNoise


def test_spatial_dropout_drops_whole_feature_maps_as_one_device_does(digits_batch, devices):
    """SpatialDropout2D, made device-independent: data parallelism's update is one device's,
    and the layer drops whole feature maps."""
    source, images, labels = digits_batch
    model = "tests.user_models:spatial_dropout_convnet"
    before, single = one_step("single", devices, source, images, labels, model=model)
    _, data = one_step("data", devices[:2], source, images, labels, model=model)
    assert max_update_difference(before, data, single) <= 1e-5
    layer = StatelessDropout(0.5, noise_shape=(None, 1, 1, None), seed=1, name="spatial")
    layer.use_step(tf.Variable(0, dtype=tf.int64))
    out = layer(tf.ones([4, 5, 5, 8]), training=True).numpy()
    assert (out == out[:, :1, :1]).all() and 0 < (out == 0).mean() < 1   # whole maps kept or dropped


def test_an_unnamed_dropout_drops_the_same_units_in_a_model_built_again(digits_batch, devices):
    """Keras names unnamed layers by a per-process count (dropout, dropout_1, ...): the one
    device's model and the data-parallel one built after it differ in their dropout's name,
    which had keyed the masks (a model 1x2 step of such a model was 0.96 apart from one
    device's, and --strategy=auto, which builds the model once first, trained another
    network than the same strategy named)."""
    source, images, labels = digits_batch
    model = "tests.user_models:unnamed_dropout_convnet"
    before, single = one_step("single", devices, source, images, labels, model=model)
    _, data = one_step("data", devices[:2], source, images, labels, model=model)
    assert max_update_difference(before, data, single) <= 1e-5


def test_layers_that_draw_their_own_noise_are_named(devices, capsys):
    par = make_parallelism("data", devices[:2], 8)
    model = par.build_model(lambda: spatial_dropout_convnet((8, 8, 1), 10, noise=True))
    assert random_layers(model) == ["noise"]
    assert random_layers(par.build_model(lambda: spatial_dropout_convnet((8, 8, 1), 10))) == []
    cfg = Config(strategy="data", batch_size=8, model="tests.user_models:spatial_dropout_convnet")
    build_model_and_optimizer(cfg, par, load_source("digits"), 10, noise=True)
    assert "note: noise draw their own random numbers on each device" in capsys.readouterr().out


def test_dropout_is_on_in_the_parity_steps(digits_batch, devices):
    """The parity checks with dropout are not the deterministic network's: the same step with
    dropout=0 moves the weights differently."""
    source, images, labels = digits_batch
    before, with_dropout = one_step("single", devices, source, images, labels)
    _, without = one_step("single", devices, source, images, labels, model="tests.user_models:small_convnet_no_dropout")
    assert max_update_difference(before, without, with_dropout) > 0.1


@pytest.fixture(scope="module")
def bn_single_step(digits_batch):
    from tests.conftest import DEVICES
    source, images, labels = digits_batch
    return one_step("single", DEVICES, source, images, labels, model=BN_MODEL)


@pytest.fixture
def float64():
    """Keras computes in float64 during the test, and in what it computed in before, after."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


@pytest.mark.parametrize("num_devices", [2, 4])
def test_data_parallel_batchnorm_step_equals_one_device(num_devices, digits_batch, devices, float64):
    """Weights and moving statistics (one_step returns every weight) move as on one device.

    In float64, as the keras.applications checks (test_parity.py): BatchNorm's backward
    subtracts nearly equal batch sums, so float32 rounding in another summation order already
    moves this model's update by 1.3e-5-1.7e-5 on a CPU where TensorFlow runs its own kernels
    (AMD EPYC with AVX2, oneDNN off), over the 1e-5 that holds with oneDNN. In float64 the same
    steps differ by ~1e-14, so the check is 1e-9: a real difference shows."""
    source, images, labels = digits_batch
    before, single = one_step("single", devices, source, images, labels, model=BN_MODEL)
    before_d, data = one_step("data", devices[:num_devices], source, images, labels, model=BN_MODEL)
    assert single[0].dtype == np.float64
    for a, b in zip(before, before_d):
        np.testing.assert_array_equal(a, b)
    assert max_update_difference(before, data, single) <= 1e-9


def test_per_replica_batchnorm_is_another_step(digits_batch, bn_single_step, devices):
    """--batchnorm=per_replica normalises each replica's share by its own statistics."""
    source, images, labels = digits_batch
    before, single = bn_single_step
    _, data = one_step("data", devices[:2], source, images, labels, model=BN_MODEL, batchnorm="per_replica")
    assert max_update_difference(before, data, single) > 0.01   # measured: 0.07


@pytest.mark.slow
def test_three_steps_of_the_default_model_on_four_devices_end_with_one_devices_weights(tmp_path, devices):
    """The default run (small_convnet with its dropout, momentum, weight decay, shuffled digits)."""
    common = dict(steps=3, batch_size=32, learning_rate=0.2, lr_schedule="constant", export=False,
                  checkpoint_every=3, log_every=3, eval_every=3)
    train(Config(run_dir=str(tmp_path / "one"), strategy="single", **common).validate(), devices[:1])
    train(Config(run_dir=str(tmp_path / "four"), strategy="data", **common).validate(), devices[:4])
    one, four = checkpoint_values(tmp_path / "one"), checkpoint_values(tmp_path / "four")
    assert one.keys() == four.keys() and len(one) > 10
    for key in one:   # weights, momentum slots, step count
        np.testing.assert_allclose(four[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.drop, self.dense = keras.layers.Dropout(0.5), keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.dense(self.drop(x, training=training))


def test_data_parallel_swaps_dropout_and_batchnorm_and_says_when_it_cannot(devices, capsys):
    par = make_parallelism("data", devices[:2], 8)
    model = par.build_model(lambda: small_resnet_bn((8, 8, 1), 10))
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert norms and all(layer.synchronized for layer in norms)
    per_replica = make_parallelism("data", devices[:2], 8, batchnorm="per_replica")
    model = per_replica.build_model(lambda: small_resnet_bn((8, 8, 1), 10))
    assert not any(getattr(layer, "synchronized", False) for layer in model.layers)
    model = par.build_model(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5)]))
    assert type(model.layers[0]) is StatelessDropout
    model = par.build_model(_Subclassed)
    assert type(model.drop) is keras.layers.Dropout
    assert "subclassed is a subclassed model, so its Dropout/BatchNormalization layers stay per-replica" in \
        capsys.readouterr().out
