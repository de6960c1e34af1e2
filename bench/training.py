"""The old name of the ``training`` worker, kept only for ``bench.jobs`` (it calls ``bench.training.main``): its
``main`` is ``bench.worker.training_main`` (run workers as ``python -m bench.worker training ARGS``)."""
from bench.worker import training_main as main  # noqa: F401
