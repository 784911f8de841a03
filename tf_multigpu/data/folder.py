"""A folder of labelled images (`--dataset=folder:PATH`): one subfolder per class.

The layout is the one Keras' `image_dataset_from_directory` and TFDS' `ImageFolder` read:

    PATH/train/CLASS/*.jpg   and   PATH/val/CLASS/*.jpg (or PATH/test/...)
    PATH/CLASS/*.jpg         (the test split is then held out: --test_fraction, default 0.2)

JPEG, PNG, BMP and GIF (first frame) files are read, in any subfolder depth of a class;
hidden files and folders (names starting with '.') are not. Symlinks are followed, each real
folder once. `val/` or `test/` beside class folders but without `train/` is refused: it would
otherwise be read as one more class.
Files are listed once, sorted, labelled by the index of their class in the sorted class
names; a held-out test split is stratified and seeded with a fixed seed (not --seed), so every
run evaluates on the same images. Records are file paths: the pipeline shuffles, skips and
shards paths, and only then reads and decodes them, in parallel inside tf.data, so nothing
but the list of paths is held in memory and a resume or another worker skips rows unread.

Unreadable images are found up front, before training, by reading each file's first and last
bytes (see `_problem`), not by decoding: an error inside tf.data would surface at the step
that first reads the file, possibly hours in, and without its name. A file damaged only in
its middle passes that check; with --skip_bad_images the pipeline drops it when its decoding
fails (`ImageSource.skip_bad_images`, data/pipeline.py), without, the run stops there.
"""

from __future__ import annotations

import os
import re

import numpy as np
import tensorflow as tf
from absl import logging

from tf_multigpu.data import augment as augments
from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
TEST_DIRS = ("val", "test")
DEFAULT_TEST_FRACTION = 0.2
SPLIT_SEED = 0
DEFAULT_SIZE = 224
_IMAGENET_CLASS = re.compile(r"n\d{8}")   # WordNet ids, ImageNet's folder names
_TAIL = 1 << 16    # bytes of a JPEG's end searched for its end marker before its whole scan
_CHUNK = 1 << 20   # bytes read at a time when a JPEG's end marker is searched past its last 16


def load_folder_source(path: str, image_size: int = 0, augment: str = "auto", test_fraction=None,
                       skip_bad_images: bool = False) -> ImageSource:
    """The ImageSource of the image folder at `path`; UsageError (one line) for bad layouts."""
    flag = f"--dataset=folder:{path}"   # that it is a directory: check_dataset_flags (data/__init__.py)
    train_dir = os.path.join(path, "train")
    test_dir = None
    if os.path.isdir(train_dir):
        test_dir = next((os.path.join(path, d) for d in TEST_DIRS if os.path.isdir(os.path.join(path, d))), None)
    else:
        train_dir = path
        misplaced = next((d for d in TEST_DIRS if os.path.isdir(os.path.join(path, d))), None)
        if misplaced:   # without train/, val/ would be read as a class and its images trained on
            raise UsageError(f"{flag}: {path} has {misplaced}/ but no train/: move the training class folders "
                             f"into {os.path.join(path, 'train')}, beside {misplaced}/ (the test split, not a class)")
    if test_dir and test_fraction is not None:
        raise UsageError(f"--test_fraction applies when {flag} has no val/ or test/ folder, but it has "
                         f"{test_dir}: drop --test_fraction")
    class_names = _class_names(train_dir, flag)
    files, labels = _list(train_dir, class_names, flag)
    if test_dir:
        unknown = sorted(set(_subdirs(test_dir)) - set(class_names))
        if unknown:
            raise UsageError(f"{flag}: {test_dir} has classes that {train_dir} lacks ({', '.join(unknown[:5])}): "
                             "give both the same class folders")
        test_files, test_labels = _list(test_dir, class_names, flag, every_class=False)
        if not test_files:
            raise UsageError(f"{flag}: {test_dir} holds no images ({'/'.join(EXTENSIONS)}): add them, "
                             "or remove it to hold out --test_fraction of train/")
    bad = _unreadable(files + (test_files if test_dir else []))
    if bad and not skip_bad_images:
        name, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UsageError(f"{name} is not a readable image ({why}){more}: remove or replace it, "
                         "or pass --skip_bad_images to train without it")
    if bad:
        skipped = {f for f, _ in bad}
        logging.warning("%s: skipping %d unreadable image(s), e.g. %s (%s)", flag, len(bad), *bad[0])
        files, labels = _without(files, labels, skipped)
        if test_dir:
            test_files, test_labels = _without(test_files, test_labels, skipped)
    if not test_dir:
        files, labels, test_files, test_labels = _hold_out(files, labels, test_fraction, flag)

    if augment == "auto":
        augment = "paper" if all(_IMAGENET_CLASS.fullmatch(c) for c in class_names) else "none"

    def records(paths, targets):
        return lambda: tf.data.Dataset.from_tensor_slices((np.array(paths), np.array(targets, np.int32)))

    source = ImageSource(
        name=f"folder:{path}",
        image_shape=(0, 0, 3),    # set by with_augment
        num_classes=len(class_names),
        class_names=tuple(class_names),
        num_train=len(files),
        num_test=len(test_files),
        pixel_dtype=tf.uint8,
        pixel_max=255.0,
        train_records=records(files, labels),
        test_records=records(test_files, test_labels),
        skipped=tuple(sorted(f for f, _ in bad)),
        skip_bad_images=skip_bad_images,
    )
    return augments.with_augment(source, read_image, augment, image_size or DEFAULT_SIZE)


def read_image(path: tf.Tensor) -> tf.Tensor:
    """The file at `path` as uint8 (h, w, 3): grey and RGBA made RGB, a GIF's first frame."""
    image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    image.set_shape((None, None, 3))
    return image


def _class_names(train_dir, flag):
    names = _subdirs(train_dir)
    if not names:
        loose = [f for f in os.listdir(train_dir) if f.lower().endswith(EXTENSIONS)]
        if loose:
            raise UsageError(f"{flag}: {train_dir} holds images but no class folders: put each class's "
                             "images in a subfolder named after the class")
        raise UsageError(f"{flag}: {train_dir} is empty: give one subfolder of images per class")
    if len(names) < 2:
        raise UsageError(f"{flag}: {train_dir} has only one class ({names[0]}): a classifier needs at "
                         "least two class folders")
    return names


def _subdirs(folder):
    return sorted(d for d in os.listdir(folder) if not d.startswith(".") and os.path.isdir(os.path.join(folder, d)))


def _list(root, class_names, flag, every_class=True):
    """Every image file under root/CLASS (recursively), sorted, with its class index.

    Hidden files are left out like hidden folders: macOS' `._photo.jpg` (AppleDouble resource
    forks, not images) would otherwise stop the run as unreadable."""
    top = os.path.realpath(root)
    # Symlinks are followed (a class folder may link to images stored elsewhere), but no real
    # folder is entered twice, nor root or a folder above it: a link back up the tree
    # (PATH/a/up -> ..) was walked ~40 levels deep and listed the other classes' images as a's.
    seen = {os.path.realpath(os.path.join(root, name)) for name in class_names}
    files, labels, empty = [], [], []
    for label, name in enumerate(class_names):
        found = []
        for folder, subdirs, names in os.walk(os.path.join(root, name), followlinks=True):
            subdirs[:] = [d for d in sorted(subdirs)
                          if not d.startswith(".") and _first_visit(os.path.join(folder, d), top, seen)]
            found += [os.path.join(folder, f) for f in names
                      if not f.startswith(".") and f.lower().endswith(EXTENSIONS)]
        if not found and every_class and os.path.isdir(os.path.join(root, name)):
            empty.append(name)
        found.sort()
        files += found
        labels += [label] * len(found)
    if empty:
        raise UsageError(f"{flag}: class folder(s) {', '.join(empty[:5])} in {root} hold no images "
                         f"({'/'.join(EXTENSIONS)}): add images or remove the folder(s)")
    return files, labels


def _first_visit(folder, top, seen) -> bool:
    """Whether `folder`'s real path is new: not in `seen`, not `top` nor above it (then it is added)."""
    real = os.path.realpath(folder)
    if real in seen or os.path.commonpath([real, top]) == real:
        return False
    seen.add(real)
    return True


def _without(files, labels, skipped):
    kept = [(f, y) for f, y in zip(files, labels) if f not in skipped]
    return [f for f, _ in kept], [y for _, y in kept]


def _hold_out(files, labels, fraction, flag):
    """A fixed, stratified split of (files, labels) into train and test, each kept in order."""
    from sklearn.model_selection import train_test_split
    fraction = DEFAULT_TEST_FRACTION if fraction is None else fraction
    try:
        train, test = train_test_split(np.arange(len(files)), test_size=fraction, random_state=SPLIT_SEED,
                                       stratify=labels)
    except ValueError as e:   # too few images per class for a stratified split
        raise UsageError(f"{flag}: cannot hold out a stratified --test_fraction={fraction} of "
                         f"{len(files)} images in {len(set(labels))} classes ({e}): add images, change "
                         "--test_fraction, or give a val/ folder beside train/") from None
    train, test = np.sort(train), np.sort(test)
    return ([files[i] for i in train], [labels[i] for i in train],
            [files[i] for i in test], [labels[i] for i in test])


def _unreadable(files):
    """[(file, why)] of the files that cannot be intact images, in listing order.

    One thread: 16 threads made the check 2x slower here (local disk, warm cache; the GIL
    costs more than the overlapped reads save). BUILD_NOTES, "Image folders", has the costs."""
    return [(f, why) for f in files for why in [_problem(f)] if why]


def _problem(path) -> str | None:
    """Why the file at `path` cannot be an intact image, or None if it looks like one.

    Reads the first and last 16 bytes: the format's signature at the start, and for JPEG,
    PNG and GIF their end marker (a truncated download, the usual corruption, loses it). That
    costs 30-80 us a file here, 11-22x less than decoding it (BUILD_NOTES, "Image folders"):
    about 2 minutes for ImageNet's 1.28M files against ~40 minutes. Only a JPEG whose last 16
    bytes lack its end marker is read further (`_jpeg_has_end`). A file whose ends are
    intact but whose middle is damaged may still fail at the step that decodes it, with
    TensorFlow's error (which does not name the file), or be dropped there with
    --skip_bad_images: rare, and the cost of not decoding twice.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            f.seek(max(os.fstat(f.fileno()).st_size - 16, 0))
            tail = f.read(16)
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    if not head:
        return "empty file"
    if head.startswith(b"\xff\xd8\xff"):
        # JPEG: the EOI marker ends the data; some writers pad after it, so look near the end,
        # and failing that (data appended after the image), after the header.
        if b"\xff\xd9" in tail or _jpeg_has_end(path):
            return None
        return "JPEG data ends early (no end-of-image marker): truncated?"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return None if b"IEND" in tail else "PNG data ends early (no IEND chunk): truncated?"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return None if b";" in tail else "GIF data ends early (no trailer): truncated?"
    if head.startswith(b"BM"):
        size = int.from_bytes(head[2:6], "little")
        return None if size <= os.path.getsize(path) else "BMP data ends early: truncated?"
    return "not JPEG, PNG, BMP or GIF data"


def _jpeg_has_end(path) -> bool:
    """Whether the JPEG at `path` has an end-of-image marker (FF D9) after its first scan starts.

    For JPEGs that do not end with one: Motion Photos append a video after the image, some
    cameras a trailer of their own (megabytes, that tf.io.decode_image ignores). A search from
    the start would find the end of an EXIF thumbnail (a whole JPEG inside the APP1 segment) in
    a truncated photo. So the header's segments are skipped by their lengths up to the start of
    scan (SOS); past it, the compressed data stuffs every FF byte (FF 00) and only restart
    markers (FF D0-D7) occur, so any FF D9 is the image's end, and a truncated file has none.
    The file's last _TAIL bytes are searched first (a phone's short trailer); only where they
    hold no marker (a long appendix, or a truncated file) is the file read from its scan on, up
    to the first marker."""
    try:
        with open(path, "rb") as f:
            f.seek(2)                                      # past SOI (FF D8)
            while True:
                marker = f.read(2)
                while marker[1:] == b"\xff":               # fill bytes before a marker
                    marker = marker[1:] + f.read(1)
                if len(marker) < 2 or marker[0] != 0xFF or marker[1] == 0xD9:
                    return False                           # cut short, or no image data
                if marker[1] == 0x01 or 0xD0 <= marker[1] <= 0xD7:
                    continue                               # markers without a length
                length = int.from_bytes(f.read(2), "big")
                if length < 2:                             # cut short, or not a segment
                    return False
                f.seek(length - 2, os.SEEK_CUR)
                if marker[1] == 0xDA:                      # SOS: the compressed data starts
                    break
            # First the last _TAIL bytes, if they are past the SOS: phones append trailers of a
            # few KiB after the end (Samsung's SEFH/SEFT), and reading each such photo whole from
            # its scan would make the up-front check read most of a phone's photos. A truncated
            # file's last bytes are compressed data (no FF D9); data appended after a real end
            # means the end exists, wherever the window finds FF D9.
            scan, size = f.tell(), os.fstat(f.fileno()).st_size
            if size - _TAIL > scan:
                f.seek(size - _TAIL)
                if b"\xff\xd9" in f.read(_TAIL):
                    return True
                f.seek(scan)
            last = b""
            while chunk := f.read(_CHUNK):
                if b"\xff\xd9" in last + chunk[:1] or b"\xff\xd9" in chunk:
                    return True
                last = chunk[-1:]
            return False
    except OSError:
        return False
