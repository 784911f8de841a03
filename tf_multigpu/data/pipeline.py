"""Seeded, resumable input pipelines that give every strategy the same global batches.

The element stream depends only on (seed, step): epoch e is the train split cut into blocks
of SHUFFLE_BLOCK records, each block permuted by a stateless RNG keyed by (seed, e, block),
then cut to whole global batches. (A stateless permutation, unlike `Dataset.shuffle`, does
not depend on TensorFlow's global seed or on how many epochs came before.) Small sets are
one block, i.e. fully shuffled each epoch. A run resumed at step K rebuilds the
stream from epoch K // steps_per_epoch and skips the records already used in it, before any
decoding, so it sees exactly the batches an uninterrupted run would. A source that augments
(`train_decode`) gets each record's position in the stream with it: the key of its random crop
is (seed, position), so augmentation keeps all of the above.

Only augmentation needs positions, so only a source that augments goes through the stream
one record at a time. The others get it a batch at a time (`_whole_batches`): after the
permutation each tf.data element is a batch, decoded per record in a parallel map, or in one
call if the source has a `batch_decode` (digits: its records are its pixels). Both paths give
the same batches (tests/test_data.py checks them against each other).

Data parallelism reads the stream in per-replica pieces: MirroredStrategy hands consecutive
elements of the per-replica dataset to replicas 0..N-1 in turn, so replica i of a step gets
rows [i*B/N, (i+1)*B/N) of the global batch that one device would see. A process of a
multi-worker run reads only its replicas' rows (`shard`), picked before decoding.

A source with `skip_bad_images` set (a folder with --skip_bad_images, data/folder.py) has the
records whose decoding fails dropped, each with a warning (tf.data's `ignore_errors`), not the
run stopped. Its stream is the same until the first such record; after it the batches move up
by one image for each one dropped, so they still depend only on the seed, but a run resumed
past a dropped image (whose skip is by record count, undecoded) is one image off the
uninterrupted run. A source without bad images gives exactly the batches above.
"""

import tensorflow as tf

from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError

AUTOTUNE = tf.data.AUTOTUNE
SHUFFLE_BLOCK = 10_000   # records, not images: undecoded bytes or indices
_EPOCH_STRIDE = 1_000_003
_MAX_EPOCHS = 1 << 40


def steps_per_epoch(source: ImageSource, global_batch: int) -> int:
    """Whole global batches per epoch (the ragged tail of each epoch is dropped)."""
    if global_batch > source.num_train:
        raise UsageError(f"--batch_size={global_batch} is larger than the {source.num_train} training "
                         f"images of {source.name}: use --batch_size<={source.num_train}")
    return source.num_train // global_batch


def train_dataset(source: ImageSource, *, seed: int, global_batch: int, batch_size: int,
                  start_step: int = 0, shard: tuple = (0, 1)) -> tf.data.Dataset:
    """Batches of `batch_size` (a replica's share, or the whole global batch) from `start_step`.

    Consecutive `global_batch / batch_size` batches make up one step's global batch; with
    `shard=(i, n)`, only those of rows [i*G/n, (i+1)*G/n) of it (one worker of n).
    A source that does not augment takes `_whole_batches`; one that does (`train_decode`),
    the per-element path below, which gives each record its position: the same batches
    either way (tests/test_data.py).
    """
    per_epoch = steps_per_epoch(source, global_batch)
    start_epoch, step_in_epoch = divmod(start_step, per_epoch)
    if not source.train_decode:
        return _whole_batches(source, seed, global_batch, batch_size, start_epoch, step_in_epoch, shard)

    def epoch(e):
        return _permuted_blocks(source, seed, e).unbatch().take(per_epoch * global_batch)

    ds = tf.data.Dataset.range(start_epoch, _MAX_EPOCHS).flat_map(epoch)
    ds = ds.skip(step_in_epoch * global_batch)           # before decoding: resume is cheap
    # Each record's global position (step * G + row) keys its augmentation: the same on every
    # strategy and worker, and after a resume.
    ds = ds.enumerate(start_step * global_batch).map(lambda i, record: (*record, i))
    return _decode_and_batch(source, seed, _rows(ds, global_batch, shard), batch_size)


def _permuted_blocks(source, seed, e):
    """Epoch e's train split as blocks of SHUFFLE_BLOCK (records, labels), each permuted."""
    def permute(block_index, block):
        records, labels = block
        key = tf.stack([tf.cast(seed, tf.int64), e * _EPOCH_STRIDE + block_index])
        order = tf.random.experimental.stateless_shuffle(tf.range(tf.shape(labels)[0]), seed=key)
        return tf.gather(records, order), tf.gather(labels, order)

    return source.train_records().batch(SHUFFLE_BLOCK).enumerate().map(permute)


def _whole_batches(source, seed, global_batch, batch_size, start_epoch, step_in_epoch, shard):
    """The per-element path's batches, made with one tf.data element per batch, not per record.

    The permuted blocks are cut straight into global batches (`rebatch` crosses block
    boundaries and drops the epoch's ragged tail, as `take` does), a resume skips whole
    global batches and a worker slices its rows out of each. Then `batch_decode` decodes a
    batch in one call; a source without one decodes per element (a parallel map between
    unbatch and batch), the only per-element stage left. No positions are carried: only
    augmentation needs them, and it takes the per-element path. tf.data's per-element work
    was most of the cost: digits, 22-45 us an image before, 2-4 after (BUILD_NOTES, "Input a
    batch at a time").
    """
    def epoch(e):
        return _permuted_blocks(source, seed, e).rebatch(global_batch, drop_remainder=True)

    ds = tf.data.Dataset.range(start_epoch, _MAX_EPOCHS).flat_map(epoch).skip(step_in_epoch)
    index, count = shard
    if count > 1:
        rows = _shard_rows(global_batch, count)
        ds = ds.map(lambda r, y: (r[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows]))
    if source.batch_decode:
        ds = ds.rebatch(batch_size, drop_remainder=True)
        ds = ds.map(lambda r, y: (source.batch_decode(r), y), num_parallel_calls=AUTOTUNE)
    else:
        # One stateless draw or file per record: faster in tf.data's parallel map than in a
        # graph loop over the batch (tf.map_fn: 1.3-1.9x slower for synthetic images here).
        ds = ds.unbatch().map(lambda r, y: (source.decode(r), y), num_parallel_calls=AUTOTUNE)
        ds = drop_undecodable(source, ds).batch(batch_size, drop_remainder=True)
    ds = ds.map(lambda x, y: (source.preprocess(x), tf.cast(y, tf.int32)), num_parallel_calls=AUTOTUNE)
    return _threads(source, ds.prefetch(AUTOTUNE))


def test_dataset(source: ImageSource, *, global_batch: int, batch_size: int,
                 shard: tuple = (0, 1)) -> tf.data.Dataset:
    """The test split as (images, labels, weights), padded to whole global batches.

    Padding rows carry weight 0, so every strategy evaluates on full, equal batches (DTensor
    needs static shapes) and the weighted sums count each real test image exactly once.
    """
    pad = -source.num_test % global_batch
    real = source.test_records().map(lambda r, y: (r, tf.cast(y, tf.int32), 1.0))
    blank = source.test_records().take(1).map(lambda r, y: (r, tf.zeros_like(tf.cast(y, tf.int32)), 0.0))
    ds = _rows(real.concatenate(blank.repeat(pad)), global_batch, shard)
    ds = ds.map(lambda r, y, w: (source.decode(r), y, w), num_parallel_calls=AUTOTUNE)
    if source.skip_bad_images:
        # A dropped image's row is made up at the end with weight 0: the evaluation counts on
        # every worker giving its share of whole global batches.
        blank = tf.data.Dataset.from_tensors((tf.zeros(source.image_shape, source.pixel_dtype), 0, 0.0))
        rows = (source.num_test + pad) // shard[1]
        ds = drop_undecodable(source, ds).concatenate(blank.repeat()).take(rows)
    ds = ds.batch(batch_size, drop_remainder=True)
    return _threads(source, ds.map(lambda x, y, w: (source.preprocess(x), y, w)).prefetch(AUTOTUNE))


def _rows(ds, global_batch, shard):
    """Records of rows [i*G/n, (i+1)*G/n) of every global batch of G, for shard (i, n).

    Applied to records, before decoding: a worker decodes only the images it trains on.
    """
    index, count = shard
    if count == 1:
        return ds
    rows = _shard_rows(global_batch, count)
    keep = ds.enumerate().filter(lambda i, record: (i % global_batch) // rows == index)
    return keep.map(lambda i, record: record)


def _shard_rows(global_batch, count):
    """Rows of each global batch that one of `count` workers reads."""
    if global_batch % count:   # check_plan refuses a global batch the replicas (so the workers) do not divide
        raise ValueError(f"global batch {global_batch} does not divide by the {count} workers reading it")
    return global_batch // count


def _decode_and_batch(source, seed, ds, batch_size):
    def decode(record, label, position):
        key = tf.stack([tf.cast(seed, tf.int64), position])
        return source.decode_train(record, key), tf.cast(label, tf.int32)

    ds = drop_undecodable(source, ds.map(decode, num_parallel_calls=AUTOTUNE))
    ds = ds.batch(batch_size, drop_remainder=True)
    # Preprocess whole batches: one vectorised op instead of one per image.
    ds = ds.map(lambda x, y: (source.preprocess(x), y), num_parallel_calls=AUTOTUNE)
    return _threads(source, ds.prefetch(AUTOTUNE))


def drop_undecodable(source, ds):
    """`ds` (decoded records) without those whose decoding failed, if the source skips bad
    images (module docstring); else `ds`, whose first failure stops the run."""
    return ds.ignore_errors(log_warning=True) if source.skip_bad_images else ds


def _threads(source, ds):
    """`ds` on a private pool of `source.input_threads` threads, if set (else tf.data's shared
    pool, one thread per core): more threads than cores pay off when reads wait on storage."""
    if not source.input_threads:
        return ds
    options = tf.data.Options()
    options.threading.private_threadpool_size = source.input_threads
    return ds.with_options(options)
