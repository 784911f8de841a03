"""2-D convolution whose kernel may be sharded on output channels under TF DTensor.

DTensor (TF 2.21) refuses `Conv2D` unless the filter is fully replicated and the input's
channel dimension is replicated, and its `Conv2DBackpropInput/Filter` expanders only accept
batch-parallel layouts.  Einsum/MatMul, GatherV2, Pad, Reshape and Transpose on leading
dimensions do accept a kernel sharded on its last (output-channel) dimension, so this module
writes the convolution with those ops only, one chunk of output rows at a time (rows are
unsharded; the batch is sharded on `batch`, so slicing it would make DTensor relayout):

    forward   y  = P @ W            P: im2col patches of a chunk of x's rows, built by ONE
                                     tf.gather with constant indices (replicated on `model`,
                                     sharded on `batch`), W: kernel as [kh*kw*cin, cout]
                                     (cout sharded); the chunks' y are concatenated.
    backward  dW = sum P^T @ dy     P rebuilt chunk by chunk from x (the only activation the
                                     backward keeps); cout stays sharded; each chunk sums
                                     within the batch's groups (an axis sharded on `batch`),
                                     the groups are summed at the end: ONE all-reduce.
              dx = Q . W3            Q: patches of the padded dy taken with FLIPPED offsets,
                                     for a chunk of x's rows, [b,rows,w,kh*kw,cout], contracted
                                     with W3 = kernel as [kh*kw, cin, cout] over (tap, cout).
                                     cout is sharded, so DTensor emits one all-reduce over
                                     `model` per chunk; together they are the size of x.

No more than one chunk of patches (CHUNK_BYTES) exists at a time, in either pass. The
previous version kept the whole-batch patch matrix (kh*kw times the input, on every `model`
device) alive from the forward to the backward, which made filter-split model parallelism
need more memory than one device.

Strided convolutions are rewritten as stride-1 ones by space-to-depth (reshape/transpose,
since DTensor has no layout propagation for tf.nn.space_to_depth): an 11x11/4 conv over 3
channels becomes a 3x3/1 conv over 48 channels (the kernel is zero-padded to 12x12), which
keeps the patch matrix small and lets the input gradient be an ordinary stride-1
transposed conv instead of a per-stride-phase one.

The same code runs on plain (non-DTensor) tensors, which is how its parity with
`tf.nn.conv2d` is tested. BUILD_NOTES.md ("Filter-split convolution against `tf.nn.conv2d`") has
the measurements behind each choice.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["CHUNK_BYTES", "row_chunks", "same_pads", "split_conv2d", "zero_from"]


def same_pads(n: int, k: int, s: int) -> tuple[int, int]:
    """tf.nn.conv2d's SAME padding of one spatial dim (the extra pixel goes bottom/right)."""
    out = -(-n // s)
    total = max((out - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def _space_to_depth(x, w, s: int, padding: str):
    """Rewrite conv(x, w, stride=s) as a stride-1 VALID conv of (x2, w2).

    x [B,H,W,C] is padded/cropped to (Hs*s, Ws*s) and regrouped so that each s x s block of
    pixels becomes one pixel with s*s*C channels (ordering (dy, dx, c)); w is zero-padded to
    (KH*s, KW*s) and regrouped the same way.  Only leading dimensions of w are touched, so an
    output-channel sharding of w is kept; x keeps its batch sharding.
    """
    kh, kw, c, o = w.shape
    h, wd = x.shape[1], x.shape[2]
    (pt, pb), (pl, pr) = ((same_pads(h, kh, s), same_pads(wd, kw, s)) if padding == "SAME"
                          else ((0, 0), (0, 0)))
    oh, ow = (h + pt + pb - kh) // s + 1, (wd + pl + pr - kw) // s + 1
    KH, KW = -(-kh // s), -(-kw // s)
    hs, ws = oh - 1 + KH, ow - 1 + KW  # stride-1 VALID over (hs, ws) gives (oh, ow)
    x = tf.pad(x, [[0, 0], [pt, max(0, hs * s - h - pt)], [pl, max(0, ws * s - wd - pl)], [0, 0]])
    x = x[:, : hs * s, : ws * s, :]  # rows/cols no output reads (VALID remainder)
    x = tf.reshape(x, [-1, hs, s, ws, s, c])
    x = tf.reshape(tf.transpose(x, [0, 1, 3, 2, 4, 5]), [-1, hs, ws, s * s * c])
    w = tf.pad(w, [[0, KH * s - kh], [0, KW * s - kw], [0, 0], [0, 0]])
    w = tf.reshape(tf.transpose(tf.reshape(w, [KH, s, KW, s, c, o]), [0, 2, 1, 3, 4, 5]),
                   [KH, KW, s * s * c, o])
    return x, w


def _patch_index(wp: int, kh: int, kw: int, rows: int, ow: int, row0: int = 0,
                 flip: bool = False) -> np.ndarray:
    """Flat spatial indices for im2col of output rows [row0, row0 + rows) of a row-major
    (hp, wp) image: [rows*ow*kh*kw].

    Entry (h, w, i, j) -> (row0 + h + i) * wp + (w + j); with flip, the taps are reversed
    (i -> kh-1-i), which is what the input gradient (a correlation with the flipped kernel)
    needs -- tf.reverse has no DTensor layout propagation, so the flip lives in the indices.
    """
    h = np.arange(rows)[:, None, None, None]
    w = np.arange(ow)[None, :, None, None]
    i = np.arange(kh)[None, None, :, None]
    j = np.arange(kw)[None, None, None, :]
    if flip:
        i, j = kh - 1 - i, kw - 1 - j
    return ((row0 + h + i) * wp + (w + j)).reshape(-1).astype(np.int32)


def row_chunks(n_rows: int, row_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Splits n_rows output rows into near-equal chunks of at most `budget` bytes of patches
    (at least one row each)."""
    per = max(1, min(n_rows, budget // max(row_bytes, 1)))
    count = -(-n_rows // per)
    edges = [round(k * n_rows / count) for k in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _map_chunks(fn, flat, wp: int, kh: int, kw: int, ow: int, chunks, flip: bool = False, after=None) -> list:
    """[fn(row0, row1, patches) for each chunk], patches [B, rows, ow, kh*kw, C] being the
    im2col of output rows [row0, row1) of a flattened image flat [B, hp*wp, C].

    One GatherV2 with constant indices per chunk: measured fastest on CPU (one pass,
    C-contiguous rows) against a concat of kh*kw strided slices and a one-hot depthwise conv.
    The channel and batch axes are untouched, so their shardings are kept; chunks run along
    output rows, an unsharded dimension (slicing the `batch`-sharded batch would make DTensor
    relayout).

    Each chunk's gather waits for the previous chunk's result (the first for `after`, if
    given): otherwise the executor, seeing independent gathers, runs them all as soon as
    their input exists and holds every chunk's patches at once -- the whole patch matrix
    again. tf.control_dependencies would say this, but DTensor's SPMD expansion drops control
    edges (measured: a 1x2 mesh ran every chunk at once), so the wait is a data dependency:
    the gather's indices add 0 computed from a scalar of the previous result.
    """
    c = flat.shape[-1]
    out = []
    prev = after
    for r0, r1 in chunks:
        index = tf.constant(_patch_index(wp, kh, kw, r1 - r0, ow, r0, flip))
        if prev is not None:
            index = index + zero_from(prev)
        patches = tf.reshape(tf.gather(flat, index, axis=1), [-1, r1 - r0, ow, kh * kw, c])
        out.append(fn(r0, r1, patches))
        prev = out[-1]
    return out


def zero_from(t):
    """An int32 0 that cannot be computed before `t`: a scalar sum of t (of its first pixel
    for an image or patches; under DTensor one all-reduce of 4 bytes) compared with +inf, which
    nothing -- not even NaN -- exceeds. Graph optimisers cannot fold it away. Only unsharded
    dimensions are sliced: slicing a sharded one makes DTensor gather the whole tensor."""
    # [batch, rows, cols, ...], or a weight-gradient chunk: [groups, taps, cin, cout] or [taps * cin, cout]
    first = tf.reduce_sum(t[:, :1, :1] if t.shape.rank >= 4 else t[:1])
    return tf.cast(first > float("inf"), tf.int32)


def _output_part(patches, w2):
    """One chunk of y = P @ W: patches [B, rows, cols, taps, cin], w2 the kernel as [taps * cin,
    cout] -> [B, rows, cols, cout], as one 2-D MatMul.

    oneDNN runs it faster than the einsum `bhwtc,tcd->bhwd` it replaces (AlexNet at batch 32,
    fwd+bwd, one device: conv2 246 -> 235 ms, conv5 74 -> 71; conv1, conv3, conv4 unchanged;
    BUILD_NOTES.md "Nineteenth session"). Under DTensor the reshape merges the batch, which may
    be sharded on `batch`, with unsharded dimensions after it, so the sharding carries over to
    the merged rows and back; cout stays sharded on `model`. Nothing is summed over a sharded
    dimension, so no collective is added (tests/test_split_conv.py counts them)."""
    rows, cols = patches.shape[1], patches.shape[2]
    flat = tf.matmul(tf.reshape(patches, [-1, w2.shape[0]]), w2)
    return tf.reshape(flat, [-1, rows, cols, w2.shape[1]])


def _weight_grad_part(patches, dy, batch_groups: int):
    """One chunk's share of dW = P^T dy: patches [B, rows, cols, taps, cin], dy [B, rows,
    cols, cout] -> [taps * cin, cout], or [groups, taps, cin, cout] summed within each of
    `batch_groups` groups of the batch (an axis DTensor keeps sharded on `batch`; the caller
    sums the groups once, one all-reduce, where summing a sharded batch here would make
    DTensor all-reduce every chunk).

    One group is a 2-D MatMul with a transposed operand: oneDNN runs it about 20% faster than
    the einsum's BatchMatMul (AlexNet conv1, batch 32: 37 against 46 ms; BUILD_NOTES
    "Seventeenth session")."""
    taps, cin, cout = patches.shape[3], patches.shape[4], dy.shape[-1]
    if batch_groups == 1:
        return tf.matmul(tf.reshape(patches, [-1, taps * cin]), tf.reshape(dy, [-1, cout]), transpose_a=True)

    def grouped(t):
        return tf.reshape(t, [batch_groups, -1, *t.shape[1:]])
    return tf.einsum("gbhwtc,gbhwd->gtcd", grouped(patches), grouped(dy))


# Bytes of patches (global shape, fp32) one chunk may hold. A chunk's patches live only
# until its matmul has run, so this bounds the convolution's transient memory; 32 MiB keeps
# each matmul large enough to run at full speed on CPU (tools/split_conv_bench.py).
CHUNK_BYTES = 32 * 2**20


def _conv_s1(x, w, pads, need_input_grad: bool, chunk_bytes: int, batch_groups: int):
    """Stride-1 convolution of x [B,H,W,C] by w [kh,kw,C,O], zero padding pads=((top, bottom),
    (left, right)), with a hand-written gradient.

    What the backward keeps is x and w only: the forward's patches (kh*kw times x, and
    replicated on every `model` device) are dropped chunk by chunk and rebuilt in the
    backward, one chunk of output rows at a time, for the weight gradient. Neither pass ever
    holds more than one chunk of patches.

    Autodiff of the forward would all-reduce the patch gradient (kh*kw times the size of x)
    and then scatter-add it back; the custom gradient contracts (tap, cout) in one einsum per
    chunk of x's rows, so the `model` all-reduces of dx are one per chunk and add up to
    exactly the size of x (the padding is applied inside, so dx is not the padded x).

    The weight gradient's chunks run one after another too, each chunk's patches gathered
    after the previous chunk's product (`_weight_grad_part`; waiting for the previous patches
    only let the gathers run ahead of the products, and TensorFlow's own CPU kernels did: 14
    chunks of conv2's patches alive at model 1x2's peak, BUILD_NOTES.md "Sixteenth
    session"). Over a sharded
    batch, a chunk's sum over the batch would be a partial sum that DTensor all-reduces as
    soon as it is read (13 all-reduces of the kernel shard instead of one, on 2x2); so the
    batch is split into `batch_groups` groups (the mesh's `batch` size) on an axis of its
    own, which DTensor keeps sharded, each chunk sums within its group only, and the groups
    are summed once at the end: one all-reduce.
    """
    kh, kw, c, o = w.shape
    h, wd = x.shape[1], x.shape[2]
    (pt, pb), (pl, pr) = pads
    hp, wp = h + pt + pb, wd + pl + pr
    oh, ow = hp - kh + 1, wp - kw + 1
    batch = x.shape[0] or 1
    isize = x.dtype.size

    def flat_padded(t):
        tp = tf.pad(t, [[0, 0], [pt, pb], [pl, pr], [0, 0]]) if pt or pb or pl or pr else t
        return tf.reshape(tp, [-1, hp * wp, c])

    y_chunks = row_chunks(oh, batch * ow * kh * kw * c * isize, chunk_bytes)

    @tf.custom_gradient
    def conv(x, w):
        w2 = tf.reshape(w, [kh * kw * c, o])
        ys = _map_chunks(lambda r0, r1, p: _output_part(p, w2), flat_padded(x), wp, kh, kw, ow, y_chunks)
        y = tf.concat(ys, axis=1) if len(ys) > 1 else ys[0]

        scope = tf.get_current_name_scope()

        def grad(dy):
            # Under the layer's name: a custom gradient's ops are made at the root, where the
            # communication report cannot tell the layer, nor that they are backward (it reads
            # "gradient_tape" or "/activation_gradients/" in a collective's name).
            with tf.name_scope(f"{scope}/activation_gradients/" if scope else "activation_gradients"):
                parts = _map_chunks(lambda r0, r1, p: _weight_grad_part(p, dy[:, r0:r1], batch_groups),
                                    flat_padded(x), wp, kh, kw, ow, y_chunks, after=dy)  # not during the forward
                dw = tf.add_n(parts)
                dw = tf.reshape(tf.reduce_sum(dw, axis=0) if batch_groups > 1 else dw, [kh, kw, c, o])
                if not need_input_grad:
                    return None, dw
                # dx[b,r,q,:] = sum_{i,j,d} dy[b, r+pt-i, q+pl-j, d] * w[i,j,:,d] (dy = 0 outside):
                # pad dy so that tap (i, j) of output pixel (r, q) sits at (r + kh-1-i, q + kw-1-j),
                # i.e. an im2col of the padded dy with flipped taps, only at x's own pixels.
                dyp = tf.pad(dy, [[0, 0], [kh - 1 - pt, kh - 1 - pb], [kw - 1 - pl, kw - 1 - pr], [0, 0]])
                dwp = wd + kw - 1
                flat = tf.reshape(dyp, [-1, (h + kh - 1) * dwp, o])
                w3 = tf.reshape(w, [kh * kw, c, o])
                x_chunks = row_chunks(h, batch * wd * kh * kw * o * isize, chunk_bytes)
                dxs = _map_chunks(lambda r0, r1, q: tf.einsum("bhwkd,kcd->bhwc", q, w3),  # o sharded: an all-reduce
                                  flat, dwp, kh, kw, wd, x_chunks, flip=True)                  # per chunk
                return (tf.concat(dxs, axis=1) if len(dxs) > 1 else dxs[0]), dw

        return y, grad

    return conv(x, w)


def split_conv2d(x, kernel, strides=1, padding="SAME", need_input_grad=True, chunk_bytes=CHUNK_BYTES,
                 batch_groups=1):
    """Exact replacement for tf.nn.conv2d(x, kernel, strides, padding) (NHWC, HWIO, no dilation)
    that DTensor accepts with `kernel` sharded on its output channels.

    Layouts under DTensor (mesh ("batch", B) x ("model", M)):
      x      ["batch", U, U, U]        (replicated on `model`: a channel-sharded input is
                                        gathered first, see split_layers.SplitConv2D)
      kernel [U, U, U, "model"]
      y      ["batch", U, U, "model"]   local channels cout / M
      dkernel like kernel; dx ["batch", U, U, U] after ONE all-reduce over `model`.

    Args:
      x: [B, H, W, Cin] float tensor (DTensor or plain).
      kernel: [kh, kw, Cin, Cout] (square or rectangular).
      strides: int or (sh, sw) -- only equal strides are supported (int or a 2-/4-tuple).
      padding: "SAME" or "VALID" (tf.nn.conv2d semantics).
      need_input_grad: False for a first layer: the backward then skips the input gradient
        (and its all-reduce); the gradient w.r.t. x is None.
      chunk_bytes: most bytes of patches (global shape) built at once, in either pass.
      batch_groups: the size of the mesh's `batch` axis, which must divide the batch. Any
        value computes the same; with fewer groups than a sharded batch has shards, DTensor
        all-reduces the weight gradient once per chunk instead of once (see _conv_s1).
    """
    s = _stride(strides)
    padding = padding.upper()
    if padding not in ("SAME", "VALID"):
        raise ValueError(f"padding must be SAME or VALID, got {padding!r}")
    x = tf.convert_to_tensor(x)
    kernel = tf.convert_to_tensor(kernel)
    if x.dtype in (tf.float16, tf.bfloat16):
        # Accumulate in float32, as cuDNN and oneDNN do for half precision. The einsums in half
        # precision sum kh*kw*cin products in it on CPUs without native support: one model 1x2
        # step differed from the stock convolution's by 0.08 in float16 (AMD EPYC without
        # AVX512-FP16; 0.003 in float32), and by 0.20 in bfloat16 (AMD EPYC with AVX2 and no
        # AVX-512; 0.046 in float32, where the data-parallel step is 0.03 from one device's).
        y = split_conv2d(tf.cast(x, tf.float32), tf.cast(kernel, tf.float32), strides, padding,
                         need_input_grad, chunk_bytes, batch_groups)
        return tf.cast(y, x.dtype)
    kh, kw = kernel.shape[0], kernel.shape[1]
    pads = ((0, 0), (0, 0))
    if s > 1:  # the s2d grid already holds the padding (its dx is ~ x's size, e.g. 228 vs 227)
        x, kernel = _space_to_depth(x, kernel, s, padding)
    elif padding == "SAME":
        pads = (same_pads(x.shape[1], kh, 1), same_pads(x.shape[2], kw, 1))
    return _conv_s1(x, kernel, pads, need_input_grad, chunk_bytes, batch_groups)


def _stride(strides) -> int:
    if isinstance(strides, int):
        return strides
    st = list(strides)
    if len(st) == 4:
        st = st[1:3]
    if len(st) == 1:
        return int(st[0])
    if len(st) != 2 or st[0] != st[1]:
        raise ValueError(f"only equal strides are supported, got {strides!r}")
    return int(st[0])
