"""tf_multigpu: multi-GPU training of ConvNets with TensorFlow 2 and Keras 3.

Data parallelism (MirroredStrategy), model parallelism (conv filters and dense units split
across devices with DTensor) and a hybrid of both, all through one training loop.
"""

__version__ = "0.1.0"
