"""The old name of the ``allreduce`` worker, kept for ``python -m bench allreduce`` (``bench.BENCHMARKS``) and
``python -m bench.allreduce ARGS``: its ``main`` is ``bench.worker.allreduce_main`` (the runners start workers as
``python -m bench.worker allreduce ARGS``)."""
import sys

from bench.worker import allreduce_main as main

if __name__ == "__main__":
    sys.exit(main())
