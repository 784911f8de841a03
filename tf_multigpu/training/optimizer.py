"""The paper's optimizer: minibatch SGD with momentum and coupled L2 weight decay.

Krizhevsky et al. 2012 (and Yadan et al. 2013) update  v <- m*v - lr*(g + wd*w),  w <- w + v.
Keras' own `weight_decay` is decoupled (w -= lr*wd*w outside the momentum), which is a
different optimizer, so the decay is folded into the gradient here. Only kernels decay
(rank >= 2), not biases, as in cuda-convnet's layer definitions.

`update_step` applies the freshly computed velocity tensor instead of re-reading the slot
variable: under DTensor, Keras' stock SGD re-read a stale slot and left the weights unchanged.
"""

import keras
from keras import ops
from keras.optimizers import schedules

from tf_multigpu.compat import NamedGradientAllReduce, optimizer_variable_index


class MomentumSGD(NamedGradientAllReduce, keras.optimizers.SGD):
    """SGD with momentum and L2 weight decay added to the gradient (coupled, as in the paper).

    The replicas' gradient all-reduce is named allreduce/gradients in profiles (the mixin).
    """

    def __init__(self, learning_rate=0.01, momentum=0.9, l2=0.0, **kwargs):
        super().__init__(learning_rate=learning_rate, momentum=momentum, **kwargs)
        self.l2 = l2

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        grad = ops.cast(gradient, variable.dtype)
        if self.l2 and len(variable.shape) >= 2:
            grad = grad + ops.cast(self.l2, variable.dtype) * variable
        if not self.momentum:
            self.assign_sub(variable, lr * grad)
            return
        velocity = self.momentums[optimizer_variable_index(self, variable)]
        new_velocity = ops.cast(self.momentum, variable.dtype) * velocity - lr * grad
        self.assign(velocity, new_velocity)
        self.assign_add(variable, new_velocity)

    def get_config(self):
        return {**super().get_config(), "l2": self.l2}


def learning_rate_schedule(peak: float, schedule: str, total_steps: int, warmup_steps: int = 0):
    """The learning rate as a function of the step (Keras schedules, so it is checkpointed
    with the optimizer's iteration count)."""
    total_steps = max(total_steps, 1)
    if schedule == "constant":
        decayed = schedules.PiecewiseConstantDecay([total_steps], [peak, peak])
    elif schedule == "step":   # the paper divided by 10 when progress stalled; here at 50% and 75%
        decayed = schedules.PiecewiseConstantDecay(
            [total_steps // 2, (3 * total_steps) // 4], [peak, peak / 10, peak / 100])
    elif schedule == "cosine":
        return schedules.CosineDecay(0.0 if warmup_steps else peak, max(total_steps - warmup_steps, 1),
                                     warmup_target=peak if warmup_steps else None,
                                     warmup_steps=warmup_steps)
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
