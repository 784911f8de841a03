"""PyTorch twins of tf_multigpu's models: the same layers, shapes and parameter counts.

Used only by the PyTorch DDP peer of the benchmark (the `torch` extra); the test suite checks
the parameter counts against the Keras models when PyTorch is installed. Inputs are NCHW,
PyTorch's native layout (Keras on TensorFlow uses NHWC): the work per step is the same.
"""

import torch
from torch import nn


def alexnet(image_shape, num_classes, dropout=0.5) -> nn.Module:
    """tf_multigpu/models/alexnet.py: conv1 96 11x11/4 (pad 2), pool 3/2, conv2 256 5x5, pool,
    conv3-5 384/384/256 3x3, pool, FC 4096, 4096 (dropout before each), classes."""
    height, width, channels = image_shape
    features = nn.Sequential(
        nn.Conv2d(channels, 96, 11, stride=4, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(96, 256, 5, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
    )
    flat = _flat_size(features, channels, height, width)
    return nn.Sequential(
        features,
        nn.Dropout(dropout), nn.Linear(flat, 4096), nn.ReLU(inplace=True),
        nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    )


def small_convnet(image_shape, num_classes, dropout=0.25) -> nn.Module:
    """tf_multigpu/models/small_convnet.py: conv32-conv64-pool-conv128-pool-fc256-fc(classes)."""
    height, width, channels = image_shape
    features = nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_size(features, channels, height, width)
    return nn.Sequential(
        features,
        nn.Linear(flat, 256), nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(256, num_classes),
    )


REGISTRY = {"alexnet": alexnet, "small_convnet": small_convnet}


def build(name: str, image_shape, num_classes) -> nn.Module:
    """The twin of a tf_multigpu registry model; KeyError for models without a twin."""
    if name not in REGISTRY:
        raise KeyError(f"no PyTorch twin of --model={name}: twins exist for {', '.join(REGISTRY)}")
    return REGISTRY[name](tuple(image_shape), num_classes)


def _flat_size(features, channels, height, width) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, channels, height, width)).shape[1])
