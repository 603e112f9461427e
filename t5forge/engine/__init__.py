"""One inference engine: encoder-decoder requests decode in a fixed set of slots with
continuous batching (docs/serving.md).

    slots.py      the device side: `Slots` (the donated slot state, compiled encode+insert
                  per row count x input bucket, and one compiled k-step decode of every slot)
    scheduler.py  the host side: `Engine` (queue, priorities, admission under an encoder
                  budget, streaming, cancellation, deadlines) and `Row`
"""
from t5forge.engine.scheduler import (Cancelled, Closed, Engine, QueueFull, QueueTimeout, Row,
                                      RowOutput, ShutDown, compile_count)
from t5forge.engine.slots import (TOP_LOGPROBS, InsertRow, Slots, SlotState, StepOut,
                                  check_fits, free_memory_bytes)

__all__ = ["Cancelled", "Closed", "Engine", "InsertRow", "QueueFull", "QueueTimeout", "Row",
           "RowOutput", "ShutDown", "SlotState", "Slots", "StepOut", "TOP_LOGPROBS",
           "check_fits", "compile_count", "free_memory_bytes"]
