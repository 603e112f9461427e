"""One inference engine: encoder-decoder requests decode in a fixed set of slots with
continuous batching (docs/serving.md).

    slots.py      the device side: `Slots` (the donated slot state, compiled encode+insert
                  per row count x input bucket, and one compiled k-step decode of every slot)
    scheduler.py  the host side: `Engine` (priorities, admission under an encoder
                  budget, streaming, cancellation, deadlines) and `Row`
    offline.py    many prompts at once for the Python API and `t5forge infer`
                  (`OfflineDecoder`)
    worker.py     the queue and worker thread both schedulers share (`QueueWorker`; the
                  static one is `t5forge.serve.batcher.Batcher`)
"""
from t5forge.engine.offline import OfflineDecoder
from t5forge.engine.scheduler import Engine, QueueTimeout, Row, RowOutput
from t5forge.engine.slots import (TOP_LOGPROBS, InsertRow, Slots, SlotState, StepOut,
                                  check_fits, free_memory_bytes)
from t5forge.engine.worker import (Cancelled, Closed, QueueFull, QueueWorker, ShutDown,
                                   WorkerDied, compile_count)

__all__ = ["Cancelled", "Closed", "Engine", "InsertRow", "OfflineDecoder", "QueueFull", "QueueTimeout", "Row",
           "QueueWorker", "RowOutput", "ShutDown", "SlotState", "Slots", "StepOut", "TOP_LOGPROBS",
           "WorkerDied", "check_fits", "compile_count", "free_memory_bytes"]
