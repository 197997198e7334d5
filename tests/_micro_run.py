"""Overrides of a small run on the random ``micro`` model: chain_sum of two digits, 4 prompts x 4 samples,
3 new tokens, no progress bars. Test files add their own evaluation cadence, steps and start."""

MICRO_RUN = [
    "model.path=builtin:micro",
    "task.name=chain_sum",
    "task.kwargs={terms: 2}",
    "sampling.prompts_per_step=4",
    "sampling.group_size=4",
    "sampling.max_new_tokens=3",
    "logging.progress=false",
]
