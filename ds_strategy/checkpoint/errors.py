"""The one error type a checkpoint that cannot be used raises, always naming the file and the problem."""


class CheckpointError(RuntimeError):
    """A path that is not a complete, readable ds_strategy checkpoint, or one that does not fit the model.

    Raised before any training state (parameters, optimizer, loop counters) has been changed.
    """
