"""Window ops on activations whose channels DTensor may keep split on `model`: sums and maxima
over a kh x kw window read as strided slices, with hand-written gradients, and the depthwise
and grouped convolutions written with them.

DTensor (TF 2.21) has no layout propagation for the backward of AvgPool, MaxPool,
DepthwiseConv2dNative or a grouped Conv2D on channel-split inputs; slices of H and W, pads,
reshapes and elementwise ops keep a channel split, so these ops use nothing else and need no
`model` communication. Autodiff of the slices would make one input-sized StridedSliceGrad per
tap; the gradients here are stride-1 correlations of the padded dy (strided: one stride phase
at a time), summed tap by tap (`_tap_sum`), so one tap is alive at a time.

The same code runs on plain tensors, which is how tests/test_split_layers.py checks each op
against the stock one. The Keras layers that call these are parallel/split_layers.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from tf_multigpu.parallel.split_conv import same_pads as _same_pads
from tf_multigpu.parallel.split_conv import zero_from


def _pads(x, kernel_size, strides, padding):
    """((top, bottom), (left, right)) zero padding of x's H and W for `padding`."""
    if padding == "valid":
        return (0, 0), (0, 0)
    return tuple(_same_pads(n, k, s) for n, k, s in zip(x.shape[1:3], kernel_size, strides))


def taps(x, kernel_size, strides, padding, pad_value=0.0):
    """The kh*kw slices [B, oh, ow, ...] a kh x kw window at `strides` reads, in (i, j)
    row-major order, the padding filled with `pad_value`. Only H and W are sliced, so any
    channel sharding of x is kept."""
    read = _tap_reader(x, kernel_size, strides, padding, pad_value)
    return [read(t) for t in range(kernel_size[0] * kernel_size[1])]


def _phase_grid(oh: int, ow: int, kernel_size, strides) -> tuple[int, int]:
    """Rows and columns of the stride-phase grid [B, hs, sh, ws, sw, ...] that the taps of an
    (oh, ow) output read."""
    (kh, kw), (sh, sw) = kernel_size, strides
    return oh - 1 + -(-kh // sh), ow - 1 + -(-kw // sw)


def _padded(x, kernel_size, strides, padding, pad_value=0.0):
    """x with H and W padded for `padding` (filled with `pad_value`), and the output's (oh, ow)."""
    (kh, kw), (sh, sw) = kernel_size, strides
    (pt, pb), (pl, pr) = _pads(x, kernel_size, strides, padding)
    if pt or pb or pl or pr:
        x = tf.pad(x, [[0, 0], [pt, pb], [pl, pr]] + [[0, 0]] * (len(x.shape) - 3), constant_values=pad_value)
    return x, (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1


def _phase_view(x, kernel_size, strides, padding, pad_value=0.0):
    """x padded for `padding` and viewed as its stride phases [B, hs, sh, ws, sw, ...] (a
    reshape), and the output's (oh, ow): tap (i, j) of the window is the unit-stride slice
    [:, i//sh : i//sh + oh, i%sh, j//sw : j//sw + ow, j%sw] of it."""
    sh, sw = strides
    x, oh, ow = _padded(x, kernel_size, strides, padding, pad_value)
    rest = [[0, 0]] * (len(x.shape) - 3)
    hs, ws = _phase_grid(oh, ow, kernel_size, strides)
    if sh > 1 or sw > 1:
        x = x[:, :hs * sh, :ws * sw]
        x = tf.pad(x, [[0, 0], [0, hs * sh - x.shape[1]], [0, ws * sw - x.shape[2]], *rest],
                   constant_values=pad_value)   # alignment only: no tap reads these cells
    return tf.reshape(x, [-1, hs, sh, ws, sw, *x.shape[3:]]), oh, ow


def _tap_reader(x, kernel_size, strides, padding, pad_value=0.0):
    """A function t -> the t-th tap of `taps`, so a caller can slice one tap at a time; t is a
    Python int or a scalar int32 tensor (a tf.while_loop's counter).

    A strided window is read through the stride-phase view [B, H/sh, sh, W/sw, sw, ...] (a
    reshape), where every tap is a unit-stride slice: TensorFlow's CPU StridedSlice with
    stride 2 measured ~4x slower than the copy of a plain slice.
    """
    kw, (sh, sw) = kernel_size[1], strides
    if sh == sw == 1:
        x, oh, ow = _padded(x, kernel_size, strides, padding, pad_value)
        rest = list(x.shape[3:])
        return _slicer(x, lambda i, j: [0, i, j], [oh, ow], rest, lambda tap: tap, kw)
    x, oh, ow = _phase_view(x, kernel_size, strides, padding, pad_value)
    rest = list(x.shape[5:])
    # tf.slice + reshape: an integer index (a shrink-axis strided slice) silently replicates a
    # channel-split tensor under DTensor.
    return _slicer(x, lambda i, j: [0, i // sh, i % sh, j // sw, j % sw], [oh, 1, ow, 1], rest,
                   lambda tap: tf.reshape(tap, [-1, oh, ow, *rest]), kw)


def _slicer(x, begin, size, rest, view, kw):
    """t -> view(x's slice at begin(i, j) of `size` (H, W dims), t = i * kw + j), whole on the
    batch and `rest` dims. Their sizes are given, not -1: DTensor keeps a sharded dimension of
    a slice whose begin is a tensor only where the size is the dimension's whole (global) size
    (slice_spmd_expander.cc); -1 would gather the batch on every tap of a hybrid mesh."""
    whole = [x.shape[0] if x.shape[0] is not None else -1]

    def read(t):
        i, j = t // kw, t % kw
        start = begin(i, j) + [0] * len(rest)
        start = tf.stack(start) if isinstance(t, tf.Tensor) else start
        return view(tf.slice(x, start, whole + size + rest))
    return read


# True while a function that only runs forward is traced (`taps_unrolled`).
_unrolled = False


@contextlib.contextmanager
def taps_unrolled():
    """Traces `_tap_sum` unrolled, no while loop: for the eval step. TensorFlow 2.21's DTensor
    names the functions it outlines from a while loop through a name cache that outlives the
    module and is keyed by the loop op's address: a later function whose loop op reuses a
    freed one's address gets that op's name, and adding it to the context's library fails
    ("Cannot add function 'while_4_body' because a different function with the same name
    already exists"; BUILD_NOTES, "Limits hit"). So only one function with loops (the train
    step) is compiled on a mesh in a process; the train step keeps them."""
    global _unrolled
    before, _unrolled = _unrolled, True
    try:
        yield
    finally:
        _unrolled = before


def _tap_sum(term, n):
    """sum over t < n of term(t), one term alive at a time: a tf.while_loop whose iterations
    run in turn. Unrolled, every tap's slice depends on x alone, so TensorFlow's executor runs
    them all as soon as x exists and the sum holds n tap-sized tensors (measured: a depthwise
    3x3 layer's fwd+bwd peaked at 12-17 input maps, 2.4 for the stock op); DTensor's SPMD
    expansion drops the control edges that could order them. Under `taps_unrolled` the sum is
    unrolled in the loop's order (the same sums, bit for bit), each tap's index made to wait
    for the sum so far (`split_conv.zero_from`: a data dependency, one 4-byte all-reduce on a mesh), so
    that one tap is alive at a time there too: with its taps made at once, an eval step's 7x7
    depthwise layer peaked at 4x the train step (BUILD_NOTES, "Twenty-eighth session")."""
    if _unrolled:
        total = term(0)
        for t in range(1, n):
            total = total + term(tf.constant(t) + zero_from(total))
        return total
    _, total = tf.while_loop(lambda t, _: t < n, lambda t, acc: (t + 1, acc + term(t)),
                             (tf.constant(1), term(0)), parallel_iterations=1)
    return total


class TapProduct(NamedTuple):
    """What window_sum does with each tap: `forward(tap, w)` its term of the output, `adjoint(f,
    w)` the term of dx from the flipped tap f of the padded dy (input-sized at stride 1, a
    stride phase's size otherwise: it may not assume H and W), and `weight(tap, dy)` the
    gradient of w, [B, ...] per example or [1, ...] already summed over the batch."""
    forward: Callable
    adjoint: Callable
    weight: Callable


# A depthwise (or average) window: tap * w, w broadcast against the tap's trailing dims.
ELEMENTWISE_PRODUCT = TapProduct(forward=lambda tap, w: tap * w, adjoint=lambda f, w: f * w,
                         weight=lambda tap, dy: tf.reduce_sum(tap * dy, axis=[1, 2]))


def window_sum(x, weights, kernel_size, strides, padding, product: TapProduct = ELEMENTWISE_PRODUCT):
    """sum over the kh*kw window taps t of product.forward(tap_t(x), weights[t]) (weights None:
    the plain sum of the taps), with a hand-written gradient.

    x is [B, H, W, ...], weights [kh*kw, ...] (elementwise: broadcasting against x's trailing
    dims). Autodiff of the strided slices would build one full-size StridedSliceGrad tensor
    per tap (measured 15x-66x the stock op's time); instead dx is the adjoint as a stride-1
    correlation of the padded dy with the flipped taps (plain slices again; strided, one stride
    phase of dx at a time, `_strided_adjoint`), and dweights one reduction per tap.
    Every sum runs tap by tap (`_tap_sum`). Every op slices or reduces H, W or the batch only,
    so a channel sharding is kept and the only collective is the batch all-reduce of dweights
    (summed once for an elementwise product; once per tap for one whose `weight` sums the
    batch itself, as the grouped convolution's does).
    """
    (kh, kw), (sh, sw) = kernel_size, strides
    h, w = x.shape[1], x.shape[2]
    (pt, _), (pl, _) = _pads(x, kernel_size, strides, padding)
    ones, n = weights is None, kh * kw

    def with_weights(apply):   # (f, t) -> apply(f, tap t's weights); f itself for a plain sum
        return (lambda f, t: f) if ones else lambda f, t: apply(f, tf.gather(weights, t))

    def weighted(read, apply):
        return read if ones else lambda t: with_weights(apply)(read(t), t)

    def forward(x, weights):
        y = _tap_sum(weighted(_tap_reader(x, kernel_size, strides, padding), product.forward), n)

        def grad(dy):
            if sh > 1 or sw > 1:
                dx = _strided_adjoint(dy, with_weights(product.adjoint), (h, w), kernel_size, strides,
                                      _pads(x, kernel_size, strides, padding))
            else:
                oh, ow, rest = dy.shape[1], dy.shape[2], list(dy.shape[3:])
                d = tf.pad(dy, [[0, 0], [kh - 1, max(0, pt + h - oh)], [kw - 1, max(0, pl + w - ow)]]
                           + [[0, 0]] * len(rest))
                # tap t of the adjoint: the flipped window's slice, tap (kh-1-i, kw-1-j) of d
                flipped = _slicer(d, lambda i, j: [0, pt + kh - 1 - i, pl + kw - 1 - j], [h, w], rest,
                                  lambda f: f, kw)
                dx = _tap_sum(weighted(flipped, product.adjoint), n)
            if ones:
                return dx, None
            if dx.shape.rank > x.shape.rank or dx.shape[-1] != x.shape[-1]:   # a multiplier broadcast x
                dx = tf.reduce_sum(dx, axis=-1, keepdims=True)
            return dx, _tap_weight_grads(x, dy, dx, kernel_size, strides, padding, product.weight)

        return y, grad

    if not ones:
        return tf.custom_gradient(forward)(x, weights)

    @tf.custom_gradient
    def pool(x):
        y, grad = forward(x, None)
        return y, lambda dy: grad(dy)[0]

    return pool(x)


def _strided_adjoint(dy, adjoint, hw, kernel_size, strides, pads):
    """dx of a strided window sum: sum over the taps t = (i, j) of adjoint(dy, t) placed at
    rows i + sh*o and columns j + sw*o' of the padded input, computed one stride phase at a
    time at the output's size.

    Row r = sh*u + a of the padded input is read by the taps i = sh*p + a only, from output
    row u - p: each phase (a, b) of dx is a stride-1 correlation of dy (padded, not dilated)
    with its own taps, flipped. Dilating dy with zeros instead (every input row, every tap)
    did sh*sw times the work: a grouped 3x3/2 layer's fwd+bwd measured 1.78x autodiff's.
    The phases are assembled and cropped to x by `_from_phases`, as window_max's are."""
    (kh, kw), (sh, sw) = kernel_size, strides
    oh, ow, rest = dy.shape[1], dy.shape[2], list(dy.shape[3:])
    hs, ws = _phase_grid(oh, ow, kernel_size, strides)
    phases = {}
    for a in range(min(sh, kh)):
        for b in range(min(sw, kw)):
            kp, kq = -(-(kh - a) // sh), -(-(kw - b) // sw)   # this phase's taps: rows a, a+sh, ...
            d = tf.pad(dy, [[0, 0], [kp - 1, hs - oh], [kq - 1, ws - ow]] + [[0, 0]] * len(rest))
            read = _slicer(d, lambda p, q, kp=kp, kq=kq: [0, kp - 1 - p, kq - 1 - q], [hs, ws], rest,
                           lambda f: f, kq)

            def term(s, a=a, b=b, kq=kq, read=read):
                return adjoint(read(s), (sh * (s // kq) + a) * kw + sw * (s % kq) + b)

            phases[a, b] = _tap_sum(term, kp * kq)
    return _from_phases(phases, strides, hw, pads)


def _from_phases(phases, strides, hw, pads):
    """The input-sized gradient [B, h, w, ...] from its stride phases {(a, b): [B, hs, ws, ...]}
    (missing ones are zero): the phase grid [B, hs, sh, ws, sw, ...] assembled by expand_dims
    + concat (DTensor's Pack replicates a channel split), viewed as the padded input (a
    reshape), and x's rows and columns cut out of it in one slice (zero rows added first
    where the grid ends before x does)."""
    (sh, sw), (h, w), ((pt, _), (pl, _)) = strides, hw, pads
    # A phase no tap reads (window < stride, e.g. ResNetV2's MaxPooling2D(1, strides=2)
    # shortcut) is 0, even where dy is inf or NaN (as the stock ops' gradients). x > x is False
    # everywhere, NaN included, and elementwise keeps the phase's layout, which a zeros_like
    # would replicate. (MulNoNan by a scalar 0 gave the result the scalar's rank-0 layout under
    # DTensor: "'tf.ExpandDims' op Rank for output 0 layout is 0 but actual rank is 5".)
    some = next(iter(phases.values()))
    zeros = tf.cast(some > some, some.dtype)
    grid = tf.concat([tf.expand_dims(tf.concat([tf.expand_dims(phases.get((a, b), zeros), 3) for b in range(sw)],
                                               axis=3), 2) for a in range(sh)], axis=2)
    dx = tf.reshape(grid, [-1, grid.shape[1] * sh, grid.shape[3] * sw, *grid.shape[5:]])
    short_h, short_w = max(0, pt + h - dx.shape[1]), max(0, pl + w - dx.shape[2])
    if short_h or short_w:
        dx = tf.pad(dx, [[0, 0], [0, short_h], [0, short_w]] + [[0, 0]] * (dx.shape.rank - 3))
    return dx[:, pt:pt + h, pl:pl + w]


def _tap_weight_grads(x, dy, after, kernel_size, strides, padding, weight):
    """[kh*kw, ...]: for each tap t, `weight(tap_t(x), dy)` summed over the batch (for the
    elementwise product, tap_t(x) * dy summed over the batch and the output positions) -- the
    gradient of window_sum's per-tap weights -- one tap at a time.

    x is first multiplied by a 1 made from `after` (dx): without it, x's padding and the loop's
    first tap depend on x alone, so the executor would make them in the forward and hold them
    to the backward (measured on a model 1x2 mesh: each depthwise layer's padded input alive
    at the backward's peak), and the loop would run beside dx's, both working sets at once.
    `weight` gives each tap's sum per example where it can ([B, kh*kw, ...], so that the batch
    is reduced, on a hybrid mesh all-reduced, once for all taps).
    """
    n = kernel_size[0] * kernel_size[1]
    read = _tap_reader(x * one_after(after, x), kernel_size, strides, padding)   # exact: x * 1

    def term(t):
        part = tf.expand_dims(weight(read(t), dy), 1)      # [B or 1, 1, ...]
        return part * tf.reshape(tf.one_hot(t, n, dtype=part.dtype), [1, n] + [1] * (part.shape.rank - 2))

    return tf.reduce_sum(_tap_sum(term, n), axis=0)


def one_after(t, like):
    """A 1 of `like`'s dtype, [B, 1, 1, ...] against `like` (an image; [B, ...] otherwise),
    that cannot be computed before t: t's first pixel compared with +inf (nothing, not even
    NaN, exceeds it, so no optimiser folds it). A data dependency, since DTensor's SPMD
    expansion drops control edges; one per example and channel, reduced over no sharded
    axis, so without a collective (split_conv's `zero_from` sums to a scalar, a 4-byte
    all-reduce on a mesh)."""
    spatial = min(3, t.shape.rank - 1)   # [B, H, W, C, ...]: H and W; [B, C]: none
    first = tf.slice(t, [0] * t.shape.rank, [-1] + [1] * (spatial - 1) + [-1] * (t.shape.rank - spatial))
    extra = [d for d in range(spatial, first.shape.rank) if like.shape[d] == 1 and first.shape[d] != 1]
    if extra:   # a depth multiplier: t has it, `like` broadcasts over it
        first = tf.reduce_max(first, axis=extra, keepdims=True)
    return 1 - tf.cast(first > float("inf"), like.dtype)


def window_max(x, pool_size, strides, padding):
    """Max pooling of x [B, H, W, C] as the max over the window's strided taps, with a
    hand-written gradient that keeps nothing but x and y.

    Autodiff of a chain of tf.maximum would keep every tap and every partial maximum for
    the backward (2*k*k - 2 tensors of the output's size: on AlexNet's pools more than the
    input itself). Here the backward re-slices the taps from x, one at a time, and routes each
    output's gradient to the first tap (row-major) that equals the maximum -- MaxPoolGrad's
    rule, and the rule the tf.maximum chain follows (ties go to its first operand). Each tap's
    share lands on its stride phase of x: the phase view [B, H/sh, sh, W/sw, sw, C] that
    `taps` reads through, written back by padding and one reshape, never a StridedSliceGrad.
    Every op slices H and W or is elementwise, so a channel sharding is kept.
    """
    (kh, kw), (sh, sw) = pool_size, strides
    h, w = x.shape[1], x.shape[2]
    (pt, pb), (pl, pr) = _pads(x, pool_size, strides, padding)
    low = x.dtype.min

    @tf.custom_gradient
    def pool(x):
        read = _tap_reader(x, pool_size, strides, padding, pad_value=low)
        y = read(0)
        for t in range(1, kh * kw):
            # One tap alive at a time, not k*k, on plain tensors. DTensor's SPMD expansion
            # drops control edges (parallel/split_conv.py), so on a mesh the taps may all be
            # live at once: a transient of k*k output-sized tensors, never kept.
            with tf.control_dependencies([y]):
                y = tf.maximum(y, read(t))

        def grad(dy):
            oh, ow = dy.shape[1], dy.shape[2]
            hs, ws = _phase_grid(oh, ow, pool_size, strides)   # the grid _tap_reader reads through
            read = _tap_reader(x, pool_size, strides, padding, pad_value=low)
            phases = {}
            zero = tf.constant(0, dy.dtype)
            remaining, done = dy, dy
            for t in range(kh * kw):
                with tf.control_dependencies([done]):   # one tap at a time (plain tensors, as above)
                    hit = tf.equal(read(t), y)
                # where(.., a scalar 0): zeros_like would be a replicated tensor under DTensor.
                share = tf.where(hit, remaining, zero)
                remaining = tf.where(hit, zero, remaining)
                i, j = divmod(t, kw)
                placed = tf.pad(share, [[0, 0], [i // sh, hs - oh - i // sh], [j // sw, ws - ow - j // sw], [0, 0]])
                key = (i % sh, j % sw)
                phases[key] = placed if key not in phases else phases[key] + placed
                done = phases[key]
            return _from_phases(phases, strides, (h, w), ((pt, pb), (pl, pr)))

        return y, grad

    return pool(x)



def depthwise_conv2d(x, kernel, strides, padding):
    """Exact depthwise convolution (NHWC, kernel [kh, kw, C, mult], Keras channel order
    c * mult + m) as a window_sum with per-tap weights: with x and kernel split on C, every
    op is local (no `model` communication) and the output is split on channels."""
    kh, kw, c, mult = kernel.shape
    if mult == 1:
        return window_sum(x, tf.reshape(kernel, [kh * kw, c]), (kh, kw), strides, padding)
    out = window_sum(tf.expand_dims(x, -1), tf.reshape(kernel, [kh * kw, c, mult]), (kh, kw), strides, padding)
    return tf.reshape(out, [-1, out.shape[1], out.shape[2], c * mult])



def grouped_conv2d(x, kernel, groups, strides, padding):
    """Exact grouped convolution (NHWC, kernel [kh, kw, C/groups, F], group g reading input
    channels and writing filters in its g-th contiguous block, as tf.nn.conv2d): a window_sum
    whose per-tap product is one einsum over a [.., groups, C/groups] view. With x split on C
    and the kernel on F, and groups divisible by the model axis, each device holds whole
    groups: every op is local and the output is split on channels. The backward keeps x, not
    the kh*kw taps that autodiff of the einsums kept (measured: 9 taps per layer, a ResNeXt-like
    model's model 1x2 peak 1,002 -> 534 MiB)."""
    kh, kw, cg, f = kernel.shape

    def grouped(t):   # [.., g * k] -> [.., g, k]
        return tf.reshape(t, [-1, t.shape[1], t.shape[2], groups, t.shape[3] // groups])

    def merged(t):
        return tf.reshape(t, [-1, t.shape[1], t.shape[2], t.shape[3] * t.shape[4]])

    # The weight gradient is summed over the batch per tap: [B, kh*kw, C/groups, F] per
    # example could be larger than the activations (ResNeXt-50's last stage: 6 maps). On a
    # hybrid mesh that is one all-reduce of a tap's kernel per tap.
    product = TapProduct(
        forward=lambda tap, w: merged(tf.einsum("bhwgc,cgf->bhwgf", grouped(tap), w)),
        adjoint=lambda d, w: merged(tf.einsum("bhwgf,cgf->bhwgc", grouped(d), w)),
        weight=lambda tap, dy: tf.expand_dims(tf.einsum("bhwgc,bhwgf->cgf", grouped(tap), grouped(dy)), 0))
    weights = tf.reshape(kernel, [kh * kw, cg, groups, f // groups])
    return window_sum(x, weights, (kh, kw), strides, padding, product)
