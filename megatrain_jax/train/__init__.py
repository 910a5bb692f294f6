"""Training: the trainers (`trainers`: stream and reference behind one protocol), the loop
(`loop`: a plain for-loop with logging, evaluation, checkpoints), its clean stop on a signal
(`stop`), the export of a run's weights (`export`) and what the machine offers and the
process uses, for the metrics (`machine`).

    summary = train(load_config("demo"))      # writes RUN_DIR/config.json, metrics.jsonl
"""

from megatrain_jax.train.export import export_run
from megatrain_jax.train.loop import TrainingStopped, train
from megatrain_jax.train.outputs import evaluate
from megatrain_jax.train.reference import ReferenceTrainer, TrainState
from megatrain_jax.train.stop import RunInterrupted, StopSignals
from megatrain_jax.train.trainers import (
    StreamTrainer,
    initial_state,
    llama_templates,
    make_trainer,
)

__all__ = ["ReferenceTrainer", "RunInterrupted", "StopSignals", "StreamTrainer", "TrainState",
           "TrainingStopped", "evaluate", "export_run", "initial_state", "llama_templates",
           "make_trainer", "train"]
