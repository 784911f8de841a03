"""The paper's optimizer: minibatch SGD with momentum and coupled L2 weight decay.

Krizhevsky et al. 2012 (and Yadan et al. 2013) update  v <- m*v - lr*(g + wd*w),  w <- w + v.
Keras' own `weight_decay` is decoupled (w -= lr*wd*w outside the momentum), which is a
different optimizer, so the decay is folded into the gradient here. Only kernels decay
(rank >= 2), not biases, as in cuda-convnet's layer definitions.

`update_step` applies the freshly computed velocity tensor instead of re-reading the slot
variable: under DTensor, Keras' stock SGD re-read a stale slot and left the weights unchanged.

A slot may be sharded more finely than its variable (a DTensor mesh with several batch groups
shards the momentum over them: parallel/placement.py, `slot_spec`). The update is then computed
on the slot's shard and the new velocity brought back to the variable's layout, through the
parallelism's `relayout_like` (the identity elsewhere).

No temporary of the update exists before its gradient does. The decay term `l2 * w` and the
decayed momentum `m * v` read only variables, so a step's graph could compute them as soon as
it starts and hold them through the forward and backward pass: 2 x the parameters (AlexNet 224,
hybrid 2x2: 0.9 GiB of its 3.7 GiB allocator peak; the memory profile showed fc6's two products
allocated before conv1's forward and alive at the step's peak). Their scalars therefore carry a
zero computed from the gradient (`_zero_from`: a data dependency, since DTensor drops control
dependencies), and the multiplies wait for it. `l2 + 0` and `m + 0` are `l2` and `m` exactly.
"""

import keras
import tensorflow as tf
from keras import ops
from keras.optimizers import schedules

from tf_multigpu.compat import NamedGradientAllReduce, optimizer_variable_index


class MomentumSGD(NamedGradientAllReduce, keras.optimizers.SGD):
    """SGD with momentum and L2 weight decay added to the gradient (coupled, as in the paper).

    The replicas' gradient all-reduce is named allreduce/gradients in profiles (the mixin).
    """

    def __init__(self, learning_rate=0.01, momentum=0.9, l2=0.0, relayout_like=None, split_dims=None, **kwargs):
        super().__init__(learning_rate=learning_rate, momentum=momentum, **kwargs)
        self.l2 = l2
        self.relayout_like = relayout_like or (lambda value, variable: value)
        self.split_dims = split_dims or (lambda variable: ())   # dims split over devices (DTensor)

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        grad = ops.cast(gradient, variable.dtype)
        velocity = self.momentums[optimizer_variable_index(self, variable)] if self.momentum else None
        # On the slot's shard: the gradient's sum arrives there, and the decay reads that
        # shard of the weights. The gradient is pinned to its variable's layout first: DTensor
        # would otherwise ask the op that makes it for the shard's layout, which a stock
        # convolution's backward refuses ("only supports batch parallel layouts").
        shard = variable if velocity is None else velocity
        grad = self.relayout_like(self.relayout_like(grad, variable), shard)
        zero = _zero_from(grad, self.split_dims(shard))   # the products below wait for the gradient
        if self.l2 and len(variable.shape) >= 2:
            weights = self.relayout_like(ops.convert_to_tensor(variable), shard)
            grad = grad + (ops.cast(self.l2, variable.dtype) + zero) * weights
        if velocity is None:
            self.assign_sub(variable, lr * grad)
            return
        new_velocity = (ops.cast(self.momentum, variable.dtype) + zero) * velocity - lr * grad
        self.assign(velocity, new_velocity)
        self.assign_add(variable, self.relayout_like(new_velocity, variable))

    def get_config(self):
        return {**super().get_config(), "l2": self.l2}


def _zero_from(t, split_dims=()):
    """Zeros computed from `t`, of its rank, length 1 on every dimension except `split_dims`
    (kept whole, so that under DTensor the slice is each device's own: no collective): an op
    that adds them to a scalar cannot run before `t` exists. `t > inf` is false for every value,
    NaN included, so the zeros are exact."""
    part = t[tuple(slice(None) if d in split_dims else slice(0, 1) for d in range(len(t.shape)))]
    return tf.cast(part > float("inf"), t.dtype)


def learning_rate_schedule(peak: float, schedule: str, total_steps: int, warmup_steps: int = 0):
    """The learning rate as a function of the step, i.e. of the updates done before it (Keras
    schedules, so it is checkpointed with the optimizer's iteration count).

    Every schedule warms up the same way (`_Warmup`): linearly, the first update already at
    peak / warmup_steps. "step" divides by 10 once half of the updates are done and again at
    three quarters (rounded up); "cosine" decays over the updates after the warm-up, reaching 0
    at step total_steps, just after the last."""
    total_steps = max(total_steps, 1)
    if schedule == "constant":
        decayed = schedules.PiecewiseConstantDecay([total_steps], [peak, peak])
    elif schedule == "step":   # the paper divided by 10 when progress stalled; here at 50% and 75%
        # PiecewiseConstantDecay keeps a value up to and including its boundary
        decayed = schedules.PiecewiseConstantDecay(
            [max(-(-total_steps // 2) - 1, 0), max(-(-3 * total_steps // 4) - 1, 0)], [peak, peak / 10, peak / 100])
    elif schedule == "cosine":
        decayed = _After(schedules.CosineDecay(peak, max(total_steps - warmup_steps, 1)), warmup_steps)
    else:
        raise ValueError(schedule)
    return _Warmup(decayed, peak, warmup_steps) if warmup_steps else decayed


class _Warmup(schedules.LearningRateSchedule):
    """Linear warm-up to `peak` over `steps`, then `after`."""

    def __init__(self, after, peak, steps):
        self.after, self.peak, self.steps = after, peak, steps

    def __call__(self, step):
        step = ops.cast(step, "float32")
        return ops.where(step < self.steps, self.peak * (step + 1) / self.steps, self.after(step))

    def get_config(self):
        return {"after": schedules.serialize(self.after), "peak": self.peak, "steps": self.steps}


class _After(schedules.LearningRateSchedule):
    """`schedule` started `offset` steps late (constant before)."""

    def __init__(self, schedule, offset):
        self.schedule, self.offset = schedule, offset

    def __call__(self, step):
        return self.schedule(ops.maximum(ops.cast(step, "float32") - self.offset, 0.0))

    def get_config(self):
        return {"schedule": schedules.serialize(self.schedule), "offset": self.offset}
