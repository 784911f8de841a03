"""--dataset=folder:PATH: real image files in, every pipeline guarantee kept, bad data named.

The acceptance tests write the digits as real 32x32 JPEG files (10 class folders, train/ and
val/) and train on them from the command line; the rest check listing, splitting, decoding,
resume, sharding and each bad-data case in-process, in well under a second each.
"""

import dataclasses
import glob
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests.conftest import run_cli
from tests.helpers import checkpoint_values, keep_only_checkpoint
from tf_multigpu.config import Config
from tf_multigpu.data import load_source, pipeline
from tf_multigpu.data.pipeline import train_dataset
from tf_multigpu.errors import UsageError
from tf_multigpu.training.loop import train

USAGE_ERROR = 2


def write_digits_folder(root, size=32):
    """The digits' fixed train/test split as JPEG files: root/{train,val}/DIGIT/NNNN.jpg."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(images, digits.target, test_size=0.2, random_state=0,
                                                        stratify=digits.target)
    for split, xs, ys in (("train", x_train, y_train), ("val", x_test, y_test)):
        big = tf.cast(tf.image.resize(xs, (size, size), method="nearest"), tf.uint8).numpy()
        for i, (image, label) in enumerate(zip(big, ys)):
            os.makedirs(os.path.join(root, split, str(label)), exist_ok=True)
            Image.fromarray(image[..., 0]).save(os.path.join(root, split, str(label), f"{i:04d}.jpg"), quality=95)
    return str(root)


def write_images(folder, count, size=(12, 16), mode="RGB", ext="png", seed=0):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        shape = size + {"RGB": (3,), "RGBA": (4,), "L": ()}[mode]
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(os.path.join(folder, f"{i:03d}.{ext}"))


@pytest.fixture(scope="module")
def digits_jpegs(tmp_path_factory):
    return write_digits_folder(tmp_path_factory.mktemp("digits_jpeg"))


@pytest.fixture
def small_folder(tmp_path):
    """3 classes of 10 PNG images each, no val/: the test split is held out."""
    for name in ("cat", "dog", "eel"):
        write_images(tmp_path / "pets" / name, 10, seed=len(name) + ord(name[0]))
    return str(tmp_path / "pets")


def _batches(ds, n):
    return [(x.numpy(), y.numpy()) for x, y in ds.take(n)]


def test_digits_folder_lists_classes_splits_and_decodes(digits_jpegs):
    source = load_source(f"folder:{digits_jpegs}", image_size=32)
    assert (source.num_train, source.num_test) == (1437, 360)
    assert source.class_names == tuple(str(d) for d in range(10)) and source.num_classes == 10
    assert source.image_shape == (32, 32, 3) and source.train_decode is None   # not ImageNet: no augment
    x, y, w = next(iter(pipeline.test_dataset(source, global_batch=64, batch_size=64)))
    assert x.shape == (64, 32, 32, 3) and x.dtype == tf.float32 and w.numpy().sum() == 64
    assert -1.0 <= float(tf.reduce_min(x)) < -0.9 and 0.9 < float(tf.reduce_max(x)) <= 1.0
    # labels are the folders': val/3/* are 3s
    labels = np.concatenate([y.numpy() for _, y in source.test_records().batch(400)])
    assert np.bincount(labels).tolist() == [36, 36, 35, 37, 36, 37, 36, 36, 35, 36]


@pytest.mark.slow
def test_folder_batches_depend_on_seed_and_step_resume_and_shard_exactly(digits_jpegs):
    source = load_source(f"folder:{digits_jpegs}", image_size=32, augment="paper")
    whole = _batches(train_dataset(source, seed=1, global_batch=32, batch_size=32), 4)
    again = _batches(train_dataset(source, seed=1, global_batch=32, batch_size=32), 4)
    resumed = _batches(train_dataset(source, seed=1, global_batch=32, batch_size=32, start_step=2), 2)
    for (xa, ya), (xb, yb) in zip(whole + whole[2:], again + resumed):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)   # the random crops and flips too
    # two workers: each reads its half of every global batch, decoded exactly as one process would
    halves = [_batches(train_dataset(source, seed=1, global_batch=32, batch_size=16, shard=(i, 2)), 4) for i in (0, 1)]
    for (x, y), (x0, y0), (x1, y1) in zip(whole, *halves):
        np.testing.assert_array_equal(np.concatenate([y0, y1]), y)
        np.testing.assert_array_equal(np.concatenate([x0, x1]), x)
    other = _batches(train_dataset(source, seed=2, global_batch=32, batch_size=32), 1)
    assert (other[0][1] != whole[0][1]).any()


def test_held_out_split_is_stratified_fixed_and_sorted(small_folder):
    source = load_source(f"folder:{small_folder}", image_size=8)
    assert source.class_names == ("cat", "dog", "eel") and (source.num_train, source.num_test) == (24, 6)
    test_labels = [int(y) for _, y in source.test_records()]
    assert test_labels == [0, 0, 1, 1, 2, 2]   # 20% of each class, listed in order
    again = load_source(f"folder:{small_folder}", image_size=8)
    assert [p.numpy() for p, _ in again.test_records()] == [p.numpy() for p, _ in source.test_records()]
    half = load_source(f"folder:{small_folder}", image_size=8, test_fraction=0.5)
    assert (half.num_train, half.num_test) == (15, 15)


def test_mixed_sizes_grey_and_formats_are_resized_to_rgb(tmp_path):
    root = tmp_path / "mixed"
    write_images(root / "a", 2, size=(20, 30), mode="L", ext="jpg")        # grey JPEG
    write_images(root / "a" / "deeper", 1, size=(50, 40), mode="RGBA", ext="png")   # subfolder, alpha
    write_images(root / "b", 2, size=(7, 9), ext="bmp")
    write_images(root / "b", 2, size=(64, 16), mode="L", ext="gif")
    (root / "b" / "notes.txt").write_text("not an image: ignored")
    source = load_source(f"folder:{root}", image_size=24, test_fraction=0.4)
    assert source.num_train + source.num_test == 7
    images = [source.decode(path) for path, _ in source.train_records().concatenate(source.test_records())]
    assert all(im.shape == (24, 24, 3) and im.dtype == tf.uint8 for im in images)
    grey = source.decode(tf.constant(str(root / "a" / "000.jpg"))).numpy()
    np.testing.assert_array_equal(grey[..., 0], grey[..., 1])   # grey made RGB: equal channels


def _bad(root, *parts, content=b"\xff\xd8\xff\xe0 this is no JPEG"):
    path = os.path.join(root, *parts)
    with open(path, "wb") as f:
        f.write(content)
    return path


@pytest.mark.parametrize("layout, needle", [
    ("missing", "no such directory"),
    ("file", "data is a file, not a folder: give a folder holding one subfolder of images per class"),
    ("val_without_train", "has val/ but no train/: move the training class folders into"),
    ("empty", "is empty: give one subfolder of images per class"),
    ("loose", "holds images but no class folders"),
    ("one_class", "has only one class (cat): a classifier needs at least two"),
    ("class_without_images", "class folder(s) dog in"),
    ("val_class_unknown", "has classes that"),
    ("too_few_to_hold_out", "cannot hold out a stratified --test_fraction=0.2 of 4 images in 2 classes"),
])
def test_bad_folders_are_one_line_errors(tmp_path, layout, needle):
    root = tmp_path / "data"
    if layout == "empty":
        root.mkdir()
    elif layout == "file":                  # e.g. an archive not yet unpacked
        root.write_bytes(b"PK\x03\x04 a zip")
    elif layout == "val_without_train":     # was trained as a third class, "val"
        for name in ("cat", "dog", "val/cat", "val/dog"):
            write_images(root / name, 5)
    elif layout == "loose":
        write_images(root, 2)
    elif layout == "one_class":
        write_images(root / "cat", 3)
    elif layout == "class_without_images":
        write_images(root / "cat", 3)
        (root / "dog").mkdir()
        (root / "dog" / "readme.txt").write_text("no images here")
    elif layout == "too_few_to_hold_out":
        for name in ("cat", "dog"):
            write_images(root / name, 2)
    elif layout == "val_class_unknown":
        for split, names in (("train", ("cat", "dog")), ("val", ("cat", "cow"))):
            for name in names:
                write_images(root / split / name, 2)
    with pytest.raises(UsageError) as e:
        load_source(f"folder:{root}", image_size=8)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_corrupt_and_truncated_images_are_named_or_skipped(small_folder):
    garbage = _bad(small_folder, "dog", "zz_garbage.jpg")
    with pytest.raises(UsageError, match=f"{garbage} is not a readable image .*--skip_bad_images"):
        load_source(f"folder:{small_folder}", image_size=8)
    os.remove(garbage)
    png = os.path.join(small_folder, "cat", "000.png")
    with open(png, "r+b") as f:           # an interrupted download: the end is missing
        f.truncate(os.path.getsize(png) // 2)
    with pytest.raises(UsageError, match=f"{png} is not a readable image .PNG data ends early"):
        load_source(f"folder:{small_folder}", image_size=8)
    source = load_source(f"folder:{small_folder}", image_size=8, skip_bad_images=True)
    assert source.skipped == (png,) and source.num_train + source.num_test == 29


def _jpeg(size=(48, 64), seed=0, quality=95):
    import io
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(
        out, "jpeg", quality=quality)
    return out.getvalue()


def test_jpeg_with_data_after_its_end_is_read_and_a_truncated_one_still_caught(tmp_path):
    root = tmp_path / "phone"
    for name in ("a", "b"):
        write_images(root / name, 5, ext="jpg")
    # A Motion Photo: the video appended after the image's end marker, no FF byte near the end
    appendix = b"\x00\x00\x00\x18ftypmp42" + np.random.default_rng(1).integers(0, 255, 300_000, np.uint8).tobytes()
    motion = root / "a" / "motion.jpg"
    motion.write_bytes(_jpeg() + appendix)
    source = load_source(f"folder:{root}", image_size=8, test_fraction=0.5)
    assert source.num_train + source.num_test == 11 and source.skipped == ()
    assert source.decode(tf.constant(str(motion))).shape == (8, 8, 3)
    # Truncated, it is refused even though an EXIF thumbnail (a whole JPEG in APP1) has an end marker
    photo = _jpeg(seed=2)
    thumbnail = _jpeg(size=(8, 8), seed=3, quality=50)
    app1 = b"Exif\x00\x00" + thumbnail
    with_thumbnail = photo[:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + photo[2:]
    assert tf.io.decode_jpeg(with_thumbnail).shape == (48, 64, 3)      # intact, it is a valid JPEG
    motion.write_bytes(with_thumbnail[:-len(photo) // 3])
    with pytest.raises(UsageError, match=f"{motion} is not a readable image .JPEG data ends early"):
        load_source(f"folder:{root}", image_size=8, test_fraction=0.5)


def test_symlink_loop_is_walked_once_and_a_linked_class_folder_still_read(tmp_path):
    root = tmp_path / "linked"
    for name in ("a", "b"):
        write_images(root / name, 3, seed=ord(name))
    write_images(tmp_path / "elsewhere" / "c", 3)
    os.symlink(tmp_path / "elsewhere" / "c", root / "c")    # a class folder stored elsewhere: read
    os.symlink("..", root / "a" / "up")                      # a loop: root/a/up/a/up/...
    os.symlink(os.path.join("..", "b"), root / "a" / "bee")  # another class's folder: read as b only
    source = load_source(f"folder:{root}", image_size=8, test_fraction=1 / 3)
    listed = [(p.numpy().decode(), int(y)) for p, y in source.train_records().concatenate(source.test_records())]
    assert sorted(listed) == [(str(root / name / f"{i:03d}.png"), label)
                              for label, name in enumerate("abc") for i in range(3)]


def test_hidden_files_like_macos_resource_forks_are_ignored(small_folder):
    # AppleDouble: what macOS writes beside each file on a foreign disk; not an image
    _bad(small_folder, "cat", "._000.png", content=b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    _bad(small_folder, "dog", ".hidden.jpg")
    source = load_source(f"folder:{small_folder}", image_size=8)
    assert source.num_train + source.num_test == 30 and source.skipped == ()


def _damage(path, content):
    """`content` written over the middle of the file at `path`: its first and last bytes intact."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 3)
        f.write(content)


@pytest.mark.parametrize("augment", ["none", "paper"])   # the batch-at-a-time and per-element paths
def test_image_damaged_in_its_middle_is_dropped_with_skip_bad_images(tmp_path, augment):
    root = tmp_path / "mid"
    for name in ("a", "b"):
        write_images(root / "train" / name, 6, size=(48, 48), seed=ord(name))
        write_images(root / "val" / name, 2, size=(48, 48), ext="jpg", seed=ord(name) + 1)

    def load(skip):
        return load_source(f"folder:{root}", image_size=8, augment=augment, skip_bad_images=skip)

    def train(source, start_step=0, steps=6):
        return _batches(train_dataset(source, seed=1, global_batch=4, batch_size=4, start_step=start_step), steps)

    def test(source, shard=(0, 1)):
        return [(x.numpy(), y.numpy(), w.numpy())
                for x, y, w in pipeline.test_dataset(source, global_batch=4, batch_size=4 // shard[1], shard=shard)]

    # Without bad images, --skip_bad_images changes no batch, from the start or resumed
    good, skipping = load(False), load(True)
    for (xa, ya), (xb, yb) in zip(train(good) + train(good, 2, 2), train(skipping) + train(skipping, 2, 2)):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)
    for a, b in zip(test(good), test(skipping)):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)

    _damage(root / "train" / "a" / "002.png", b"\x00" * 500)
    _damage(root / "val" / "b" / "001.jpg", b"\xff" * 200)
    assert load(True).skipped == ()          # the ends are intact: the up-front check passes them
    with pytest.raises(tf.errors.InvalidArgumentError, match="DecodeImage"):
        train(load(False))                   # without the flag the run stops (the loop says so in one line)
    skipping = load(True)
    batches = train(skipping, steps=9)       # 3 epochs of 11 good images
    assert len(batches) == 9 and all(x.shape == (4, 8, 8, 3) for x, _ in batches)
    (x, y, w), = test(skipping)              # the bad one's row is a blank at the end, weight 0
    assert w.tolist() == [1, 1, 1, 0] and y[:3].tolist() == [0, 0, 1] and (x[3] == -1).all()
    halves = [test(skipping, shard=(i, 2)) for i in (0, 1)]   # each worker its whole share
    assert [len(h) for h in halves] == [1, 1] and sum(h[0][2].sum() for h in halves) == 3


def test_folder_only_flags_are_refused_elsewhere(small_folder):
    with pytest.raises(UsageError, match="apply to --dataset=folder:PATH, not digits"):
        load_source("digits", skip_bad_images=True)
    with pytest.raises(UsageError, match="--augment=paper applies to photos"):
        load_source("digits", augment="paper")
    os.makedirs(os.path.join(small_folder, "train"))
    for name in ("cat", "dog"):
        shutil.copytree(os.path.join(small_folder, name), os.path.join(small_folder, "train", name))
        shutil.copytree(os.path.join(small_folder, name), os.path.join(small_folder, "val", name))
    with pytest.raises(UsageError, match="--test_fraction applies when .* has no val/"):
        load_source(f"folder:{small_folder}", image_size=8, test_fraction=0.3)
    assert load_source(f"folder:{small_folder}", image_size=8).num_test == 20   # val/ is the test split


@pytest.mark.slow
def test_corrupt_jpeg_stops_the_cli_naming_it_and_skip_trains_and_counts_it(small_folder, tmp_path):
    bad = _bad(small_folder, "eel", "broken.jpg")
    args = [f"--dataset=folder:{small_folder}", "--image_size=8", "--batch_size=8", "--steps=2",
            "--cpu_devices=2", "--noexport"]
    done = run_cli(f"--run_dir={tmp_path / 'stop'}", *args)
    assert done.returncode == USAGE_ERROR
    assert done.stderr.strip().splitlines()[-1] == (
        f"tf-multigpu-train: error: {bad} is not a readable image (JPEG data ends early (no end-of-image marker): "
        "truncated?): remove or replace it, or pass --skip_bad_images to train without it")
    done = run_cli(f"--run_dir={tmp_path / 'skip'}", *args, "--skip_bad_images")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.load(open(tmp_path / "skip" / "summary.json"))
    assert summary["skipped_images"] == 1 and summary["step"] == 2



def test_an_image_damaged_in_its_middle_stops_the_cli_in_one_line(small_folder, tmp_path):
    """Past the up-front check, tf.data's decode error was a 40-line graph error, exit 1."""
    bad = sorted(glob.glob(os.path.join(small_folder, "*", "*.png")))[0]
    _damage(bad, b"\x00" * 50)   # inside the 12x16 image's pixel data, its ends intact
    done = run_cli(f"--run_dir={tmp_path / 'stop'}", f"--dataset=folder:{small_folder}", "--image_size=8",
                   "--batch_size=8", "--steps=20", "--cpu_devices=2", "--noexport")
    assert done.returncode == USAGE_ERROR, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("tf-multigpu-train: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert errors[0] == (f"tf-multigpu-train: error: an image of --dataset=folder:{small_folder} cannot be decoded "
                         "(Invalid PNG data, size " + errors[0].split("size ")[1].split(")")[0] + "): it is damaged "
                         "inside, past the first and last bytes checked before training; pass --skip_bad_images to "
                         "train without such images")

@pytest.mark.slow
@pytest.mark.parametrize("strategy, flags", [
    ("data", ["--cpu_devices=2"]),
    ("hybrid", ["--cpu_devices=4", "--mesh=batch:2,model:2"]),
])
def test_trains_on_a_folder_of_jpegs_to_95_percent(digits_jpegs, tmp_path, strategy, flags):
    run_dir = tmp_path / "run"
    # 16x16 (the digits are 8x8): the resize and the model are exercised at a quarter of 32x32's cost
    done = run_cli(f"--run_dir={run_dir}", f"--dataset=folder:{digits_jpegs}", "--image_size=16",
                   f"--strategy={strategy}", *flags, "--epochs=5", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["dataset"] == f"folder:{digits_jpegs}" and summary["skipped_images"] == 0
    metadata = json.load(open(run_dir / "export" / "assets.extra" / "metadata.json"))
    assert metadata["class_names"] == [str(d) for d in range(10)] and metadata["input_shape"] == [16, 16, 3]


@pytest.mark.slow
def test_killed_folder_run_resumes_to_the_weights_of_an_uninterrupted_run(digits_jpegs, tmp_path, devices,
                                                                         capsys):
    cfg = Config(run_dir=str(tmp_path / "whole"), dataset=f"folder:{digits_jpegs}", image_size=32,
                 augment="paper", steps=6, checkpoint_every=3, log_every=3, eval_every=6, batch_size=32,
                 export=False)
    train(cfg, devices[:2])                 # 44 steps per epoch: step 3 is mid-epoch
    whole = checkpoint_values(cfg.run_dir)
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(cfg.run_dir, resumed_dir)
    keep_only_checkpoint(resumed_dir, 3)    # as if killed right after the checkpoint of step 3
    capsys.readouterr()
    train(dataclasses.replace(cfg, run_dir=resumed_dir), devices[:2])
    assert "steps 3..6" in capsys.readouterr().out   # resumed, not trained again from step 0
    resumed = checkpoint_values(resumed_dir)
    assert whole.keys() == resumed.keys()
    for name in whole:
        np.testing.assert_array_equal(whole[name], resumed[name], err_msg=name)
