"""`python -m torch.distributed.run ... eager_trainer.py <hf_trainer flags>`: transformers'
Trainer as `harness.hf_trainer` runs it, with dynamo's eager backend in place of inductor,
so that `--compile` traces and wraps the model for real on a CPU without a C++ toolchain."""

import sys

from trainplan.bench.harness import hf_trainer

real = hf_trainer.trainer_arguments
hf_trainer.trainer_arguments = lambda *a, **kw: {**real(*a, **kw), "torch_compile_backend": "eager"}
sys.exit(hf_trainer.main(sys.argv[1:]))
