"""The Lightning ``Trainer`` keywords a test passes to keep its run free of side effects: no logger, no checkpoint
callback writing into the working directory, no progress bar or model summary in the captured output. Spelled once
here instead of in every test that builds a ``Trainer``."""

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
