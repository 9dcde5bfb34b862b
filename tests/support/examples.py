"""What the tests pass to the examples."""

# The examples' transformer at its smallest (one block of width 32): a few seconds of work per run.
TINY = ["--vocab", "32", "--seq-len", "16", "--d-model", "32", "--n-heads", "4", "--n-layers", "1", "--batch-size", "8"]
