"""Logical axis names shared by the networks and the partitioner.

Every parameter is created with logical axis names (T5X's vocabulary), so that a
rules table alone decides how it is sharded. Activations are constrained at block
boundaries with the activation names below.
"""

# Parameter axes (T5X's names).
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV = "kv"
JOINED_KV = "joined_kv"
RELPOS_BUCKETS = "relpos_buckets"
LAYERS = "layers"  # the stacked axis of scanned layers

# Activation axes.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "embed"
ACT_MLP = "mlp"
ACT_HEADS = "heads"
ACT_KV = "kv"
ACT_VOCAB = "vocab"

PARAM_AXES = (VOCAB, EMBED, MLP, HEADS, KV, JOINED_KV, RELPOS_BUCKETS, LAYERS)
